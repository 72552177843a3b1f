"""CUDA → CPU redirect and a ``torch.cuda`` stand-in, so Megatron's training loop runs on CPU.

Test-and-demo only (docs/design.md §5): ``install()`` is called in each CPU rank before Megatron
parses its arguments; nothing on the GPU path imports this module. Nothing of the loop's logic is
shimmed — only where tensors live and what ``torch.cuda`` answers. The shims, by category, with the
megatron-core 0.19.2 sites each one covers (``SHIMS`` lists them for the command's banner):

- **device redirect** (:class:`CudaToCpu`, a ``TorchFunctionMode``): ``device="cuda"`` /
  ``torch.cuda.current_device()`` (an int) / ``torch.device("cuda:N")`` in factory functions
  (``training.py`` start-time all-reduces, ``training_log``/``evaluate`` loss tensors,
  ``utils.average_losses_across_data_parallel_group``, ``rerun_state_machine`` counters, DDP
  ``param_and_grad_buffer`` buffers, the optimizer's ``found_inf``/grad-norm tensors,
  ``schedules.forward_backward_*`` loss accumulators, ``p2p_communication`` receive buffers,
  ``initialize`` seeds); ``Tensor.cuda()`` and ``Tensor.to(<cuda>)`` (``get_batch_on_this_tp_rank``,
  the optimizer's main-param copies, checkpoint loading); ``pin_memory()`` / ``pin_memory=True``;
  ``Tensor.type()`` names a CUDA type (``clip_grads.clip_grad_by_total_norm_fp32`` and the
  optimizers' ``'torch.cuda.FloatTensor'`` checks). A mode is off while its handler runs the call,
  so a backward dispatched through it (``torch.autograd.backward`` in ``schedules.backward_step``)
  would run every backward hook without the redirect: the autograd engine's entry
  (``_engine_run_backward``) re-enters the mode (Megatron-FSDP's post-accumulate-grad hooks
  allocate their bf16 gradient buckets on ``torch.device("cuda")``, ``param_and_grad_buffer``).
- **torch.cuda queries** (:func:`install_cuda_standin`): ``is_available``/``device_count``
  (``initialize._initialize_distributed``, ``initialize_megatron``'s CUDA assert), ``set_device``,
  ``current_device``, device name/properties/capability (``training`` logging, TE/feature gates),
  streams, events and ``synchronize`` (``timers``, DDP overlap, ``p2p_communication``,
  ``optimizer``), memory statistics (``training_log``'s memory report, ``empty_cache``),
  the CUDA RNG state (``tensor_parallel.random``, ``checkpointing.get_rng_state`` — a real
  generator whose state is saved and restored with the checkpoint).
- **JIT fuser off**: ``megatron.core.jit.disable_jit_fuser()`` (its ``torch.compile``'d fused
  kernels target GPUs).

Fused CUDA kernels are switched off with Megatron's own flags (``FUSION_OFF_FLAGS``), never
re-implemented here.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpu", "install", "uninstall", "installed", "SHIMS", "FUSION_OFF_FLAGS"]

# Megatron's own switches for every fused CUDA kernel the CPU cannot run.
FUSION_OFF_FLAGS = (
    "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
)

SHIMS = {
    "device redirect": "cuda devices/ids -> cpu in factory functions, Tensor.cuda/.to, pin_memory, "
    "also inside backward hooks",
    "torch.cuda stand-in": "availability, count, set_device, properties, streams, events, synchronize, "
    "memory stats, RNG state (a real generator, saved/restored)",
    "JIT fuser": "megatron.core.jit.disable_jit_fuser()",
    "megatron-core CPU spots": "megatron_hsap.megatron.cpu_shims (RoPE inv_freq, memory buffer, causal mask, "
    "RNG tracker, the MoE all-to-all dispatcher's host split sizes)",
    "norms without TE": "megatron_hsap.megatron.cpu.rank (HybridStack's final TENorm -> WrappedTorchNorm; "
    "under --sequence-parallel WrappedTorchNorm's params marked for the TP gradient sum, as apex's are)",
}

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal (torch.cuda.current_device()); bools are not devices.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpu(TorchFunctionMode):
    """Maps every CUDA device a Megatron call names to the CPU; ``pin_memory`` becomes a no-op."""

    _IDENTITY = {torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.record_stream}
    # Random factories take the generator of the device they name: a CUDA draw must not advance the
    # CPU generator (Megatron's JIT warm-up draws a CP-dependent number of CUDA randoms before the
    # model is initialised on the CPU generator).
    _RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.rand_like,
               torch.randn_like, torch.randint_like}

    # Ops that draw on their tensor's device at run time (dropout): on a GPU they use the CUDA
    # generator, which Megatron's RNG tracker forks per region; here they use the stand-in's.
    _DEVICE_DRAWS = {torch.nn.functional.dropout, torch.dropout, torch.bernoulli, torch.Tensor.bernoulli_,
                     torch.nn.functional.dropout1d, torch.nn.functional.dropout2d, torch.nn.functional.dropout3d}

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self._generator = generator

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in self._DEVICE_DRAWS:
            saved = torch.get_rng_state()
            torch.set_rng_state(self._generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                self._generator.set_state(torch.get_rng_state())
                torch.set_rng_state(saved)
        if func in self._IDENTITY:
            return args[0] if func is not torch.Tensor.record_stream else None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The type name of a tensor that "is" on the GPU (the optimizer and grad clipping assert
            # 'torch.cuda.FloatTensor'); with a target dtype, .type() converts as usual.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
            if func in self._RANDOM and kwargs.get("generator") is None and not func.__name__.endswith("_like"):
                kwargs["generator"] = self._generator
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _Stream(torch.Stream):
    """A CPU stream: work runs in program order, so every wait is already satisfied. A
    ``torch.Stream`` (of the CPU), so that ``Tensor.record_stream(stream)`` parses its argument and
    reaches the redirect, which makes it a no-op (Megatron's A2A-overlap schedule records its
    inputs on its communication stream)."""

    def __new__(cls, device: Any = None, priority: int = 0, **_: Any) -> "_Stream":
        return super().__new__(cls, device=_CPU)

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self._priority = priority

    @property
    def priority(self) -> int:
        return self._priority

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...

    def record_event(self, event: Any = None) -> "_Event":
        event = event or _Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: object) -> None: ...


class _Event:
    """A CPU event that records host time, so ``elapsed_time`` is real."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_Event") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs two recorded events")
        return (end._t - self._t) * 1000.0


class _Rng:
    """The stand-in CUDA generator: a real CPU generator whose state checkpoints save and restore."""

    def __init__(self) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(0)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        self.generator.set_state(state.cpu() if isinstance(state, torch.Tensor) else state)

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))


def _properties() -> types.SimpleNamespace:
    return types.SimpleNamespace(name="cpu (megatron-hsap stand-in)", total_memory=24 << 30, major=8, minor=0,
                                 multi_processor_count=1, is_integrated=False, uuid="cpu")


def _const(name: str, value: Any) -> Callable[..., Any]:
    """A distinct named function returning ``value`` (torch.compile's rule map keys functions by
    identity: one object under two ``torch.cuda`` names would collide)."""

    def standin(*args: Any, **kwargs: Any) -> Any:
        return value() if callable(value) else value

    standin.__name__ = standin.__qualname__ = name
    return standin


def _standins(rng: _Rng) -> dict[str, Any]:
    consts: dict[str, Any] = {
        "is_available": True, "is_initialized": True, "device_count": 1, "current_device": 0,
        "set_device": None, "synchronize": None, "empty_cache": None, "set_stream": None,
        "reset_peak_memory_stats": None, "is_current_stream_capturing": False,
        "get_device_name": lambda: _properties().name, "get_device_properties": _properties,
        "get_device_capability": (8, 0), "current_stream": _Stream, "default_stream": _Stream,
        "memory_allocated": 0, "max_memory_allocated": 0, "memory_reserved": 0, "max_memory_reserved": 0,
        "memory_stats": dict, "mem_get_info": (24 << 30, 24 << 30),
    }
    table = {name: _const(name, value) for name, value in consts.items()}

    def stream(s: Any = None) -> Any:
        return contextlib.nullcontext(s)

    def manual_seed_all(seed: int) -> None:
        rng.manual_seed(seed)

    table.update(Stream=_Stream, Event=_Event, stream=stream, get_rng_state=rng.get_rng_state,
                 set_rng_state=rng.set_rng_state, manual_seed=rng.manual_seed, manual_seed_all=manual_seed_all,
                 default_generators=(rng.generator,))
    return table


_ORIGINALS: dict[tuple[Any, str], Any] = {}
_MODE: list[CudaToCpu] = []


def _patch(owner: Any, name: str, value: Any) -> None:
    if (owner, name) not in _ORIGINALS:
        _ORIGINALS[(owner, name)] = getattr(owner, name, None)
    setattr(owner, name, value)


def _rng_hook(rng: _Rng, name: str) -> Callable[..., Any]:
    if name.startswith("_get"):
        def get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
            return rng.get_rng_state()
        return get_state

    def set_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        rng.set_rng_state(state)
    return set_state


def _import_megatron_without_jit() -> Any:
    """Import megatron-core with its JIT fuser off from the start.

    ``megatron.core.jit.jit_fuser`` is ``torch.compile`` and is applied when each fused module is
    imported — and importing ``megatron.core.jit`` imports ``megatron.core`` and those modules
    first, so ``disable_jit_fuser()`` afterwards is too late. While megatron-core and
    ``megatron.training`` import, ``torch.compile`` is an identity decorator (what
    ``disable_jit_fuser`` makes ``jit_fuser``); then the fuser is disabled for later imports.
    """
    import sys

    if "megatron.core" in sys.modules:
        from megatron.core import jit

        jit.disable_jit_fuser()
        return jit
    compile_ = torch.compile

    def identity(fn: Any = None, *args: Any, **kwargs: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    torch.compile = identity  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
        import megatron.training  # noqa: F401
        from megatron.core import jit
    finally:
        torch.compile = compile_  # type: ignore[assignment]
    jit.disable_jit_fuser()
    return jit


def install() -> None:
    """Redirect CUDA to the CPU in this process (idempotent); call before Megatron parses arguments."""
    if _MODE:
        return
    from megatron_hsap.megatron.cpu import gdn_kernels, mamba_kernels

    mamba_kernels.install()  # before megatron-core's Mamba mixer and gated delta net read their kernels
    gdn_kernels.install()
    jit = _import_megatron_without_jit()
    from megatron.core.tensor_parallel import random as tp_random

    from megatron_hsap.megatron import cpu_shims

    rng = _Rng()
    for name, value in _standins(rng).items():
        _patch(torch.cuda, name, value)
    # torch's own device-generic layer (torch.optim's graph-capture check) must still see a CPU
    # machine: it would ask the real CUDA runtime once torch.cuda says it is available.
    _patch(torch.accelerator, "current_accelerator", _const("current_accelerator", None))
    _patch(torch.accelerator, "is_available", _const("is_available", False))
    # tensor_parallel.random captured torch.cuda's RNG functions at import time.
    for name in ("_set_cuda_rng_state", "_get_cuda_rng_state"):
        if hasattr(tp_random, name):
            _patch(tp_random, name, _rng_hook(rng, name))
    jit.disable_jit_fuser()
    cpu_shims.install(rng=False)  # Megatron's own CUDA RNG tracker runs, on the stand-in generator
    mode = CudaToCpu(rng.generator)
    engine_run_backward = torch.autograd.graph._engine_run_backward

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        with mode:  # hooks see the redirect even when the backward call came through the mode
            return engine_run_backward(*args, **kwargs)

    for owner in (torch.autograd, torch.autograd.graph):  # torch.autograd imported the name
        _patch(owner, "_engine_run_backward", run_backward)
    mode.__enter__()
    _MODE.append(mode)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    from megatron_hsap.megatron import cpu_shims

    while _MODE:
        _MODE.pop().__exit__(None, None, None)
    for (owner, name), original in list(_ORIGINALS.items()):
        setattr(owner, name, original)
    _ORIGINALS.clear()
    cpu_shims.uninstall()


def installed() -> bool:
    return bool(_MODE)


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """``with on_cpu(): ...`` installs the redirect for the block."""
    install()
    try:
        yield
    finally:
        uninstall()
