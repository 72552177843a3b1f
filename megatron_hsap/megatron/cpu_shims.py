"""CPU-only shims for megatron-core 0.19.2's CUDA assumptions (docs/design.md §5).

Imported ONLY by the tests and the CPU demo (``megatron-hsap train-tiny``); never on the GPU path
(the core attention, the spec, batch sharding and the wrapper script do not import it). Each shim
replaces one CUDA-only spot with the same computation on the tensor's own device, so that a
megatron-core ``GPTModel`` built with ``use_cpu_initialization=True`` trains under gloo:

- ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``;
- ``rope_utils.get_pos_emb_on_this_cp_rank`` uses ``pin_memory`` and ``.cuda()`` (only reached by
  Megatron's own zigzag CP path, patched so a CPU reference run of the *ring* layout works);
- ``GlobalMemoryBuffer.get_tensor`` allocates on the current CUDA device;
- ``transformer.utils.get_default_causal_mask`` builds its mask with ``device="cuda"``;
- the CUDA RNG tracker (``fork()`` seeds a CUDA generator): replaced by a tracker whose
  ``fork()`` uses a CPU generator per name, so dropout regions stay reproducible;
- activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA generator's
  state: on CPU there is none to save, so those two calls become no-ops;
- the MoE all-to-all token dispatcher (``--moe-token-dispatcher-type alltoall``) copies its split
  sizes to the host with ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts
  only CUDA tensors: on CPU they stayed tensors, and ``all_to_all_single`` refuses tensor split
  sizes (a ``TypeError``, the CP=1 reference alike). The shim gives host tensors the numpy arrays a
  GPU run gets.

``install()`` is idempotent and can be undone with ``uninstall()`` (tests use it as a context).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["install", "uninstall", "installed", "cpu_shims"]

# (owner object, attribute name) -> original value, for uninstall().
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _patch(owner: Any, name: str, value: Any) -> None:
    key = (owner, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(owner, name)
    setattr(owner, name, value)


def _rotary_get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` on ``inv_freq``'s own device: ``[s, 1, 1, rot_dim]``."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, rot_dim / 2]
    if self.rotary_interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)  # f0 f0 f1 f1 ...
    else:
        emb = torch.cat((freqs, freqs), dim=-1)  # f0 f1 ... f0 f1 ...
    return emb[:, None, None, :]


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Megatron's zigzag slice (chunks ``r`` and ``2P-1-r`` of ``2P``) without pinned/CUDA memory."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    size, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * size, dim=seq_dim)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=seq_dim)


def _memory_buffer_get_tensor(
    self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` on CPU (a fresh tensor: nothing to reuse on the host)."""
    del mem_alloc_context
    numel = 1
    for size in tensor_shape:
        numel *= int(size)
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype)
        self.buffer[(name, dtype)] = buffer
    return buffer[:numel].view(*tensor_shape)


def _default_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` bool, True above the diagonal (masked), on CPU."""
    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


class CPURNGStatesTracker:
    """Stand-in for Megatron's ``CudaRNGStatesTracker``: named CPU generator states.

    ``fork(name)`` swaps the global CPU RNG state for the named one and back, which is what the
    CUDA tracker does for the CUDA generator (tensor-parallel ranks draw different dropout masks
    in model-parallel regions).
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"cpu rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            # Megatron seeds this in model_parallel_cuda_manual_seed (CUDA only); a fixed seed
            # keeps CPU runs reproducible without it.
            self.add(name, 2718 + len(self.states_))
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


_TRACKER = CPURNGStatesTracker()


def _get_rng_tracker(*args: Any, **kwargs: Any) -> CPURNGStatesTracker:
    del args, kwargs
    return _TRACKER


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    del args, kwargs
    return None


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``maybe_move_tensor_to_cpu`` for tensors already on the host: with ``as_numpy`` the numpy
    array a CUDA tensor's copy becomes (no stream to record on CPU)."""
    del record_stream
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _targets(rng: bool = True) -> list[tuple[Any, str, Callable[..., Any]]]:
    from megatron.core import utils as core_utils
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import token_dispatcher

    targets: list[tuple[Any, str, Callable[..., Any]]] = [
        (rotary_pos_embedding.RotaryEmbedding, "get_emb", _rotary_get_emb),
        (rope_utils, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank),
        (rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank),
        (core_utils.GlobalMemoryBuffer, "get_tensor", _memory_buffer_get_tensor),
        (transformer_utils, "get_default_causal_mask", _default_causal_mask),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),  # (imported by name there)
    ]
    if not rng:  # the caller provides a CUDA generator stand-in (megatron/cpu/device.py)
        return targets
    targets += [
        (tp_random, "get_cuda_rng_tracker", _get_rng_tracker),
        (tp_random, "_get_cuda_rng_state", _no_cuda_rng_state),
        (tp_random, "_set_cuda_rng_state", _no_cuda_rng_state),
    ]
    # Modules that imported the names before the patch hold their own references.
    import megatron.core.tensor_parallel as tp_pkg
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.gated_delta_net import common as gdn_common

    targets.append((tp_pkg, "get_cuda_rng_tracker", _get_rng_tracker))
    targets.append((mamba_mixer, "get_cuda_rng_tracker", _get_rng_tracker))
    targets.append((gdn_common, "get_cuda_rng_tracker", _get_rng_tracker))
    return targets


def install(*, rng: bool = True) -> None:
    """Patch megatron-core's CUDA-only spots for CPU runs. Idempotent.

    ``rng=False`` leaves Megatron's CUDA RNG tracker alone (for a process whose ``torch.cuda``
    RNG functions are a stand-in with a real generator)."""
    for owner, name, value in _targets(rng):
        if hasattr(owner, name):
            _patch(owner, name, value)


def uninstall() -> None:
    """Restore every patched attribute."""
    for (owner, name), original in list(_ORIGINALS.items()):
        setattr(owner, name, original)
    _ORIGINALS.clear()
    _TRACKER.reset()


def installed() -> bool:
    return bool(_ORIGINALS)


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """``with cpu_shims(): ...`` installs the shims for the block and restores them afterwards."""
    was_installed = installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
