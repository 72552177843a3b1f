"""The CPU real-loop shims (``megatron_hsap/megatron/cpu/device.py``) and the run's hardware choice.

The device redirect is process-global (a ``TorchFunctionMode`` and a patched ``torch.cuda``), so its
checks run in a fresh interpreter; the hardware rule is pure.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.hardware import resolve_hardware
from megatron_hsap.plan.hardware import hardware_for_device

_CHECKS = textwrap.dedent("""
    import torch
    from megatron_hsap.megatron.cpu import device
    device.install()
    # factories and moves naming CUDA land on the CPU
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu" and torch.ones(2).to("cuda:0").device.type == "cpu"
    assert torch.ones(2).pin_memory().device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"  # what grad clipping asserts
    assert torch.ones(2).type(torch.float64).dtype == torch.float64  # a conversion stays a conversion
    # CUDA draws come from the stand-in generator: the CPU generator (weight init) does not move
    cpu_state = torch.get_rng_state()
    torch.rand(1000, device="cuda"); torch.randn(10, device="cuda")
    torch.nn.functional.dropout(torch.ones(100), 0.5, training=True)
    assert torch.equal(cpu_state, torch.get_rng_state())
    # the CUDA RNG state is real: saved, advanced, restored -> the same draws
    saved = torch.cuda.get_rng_state()
    a = torch.rand(5, device="cuda")
    torch.cuda.set_rng_state(saved)
    assert torch.equal(a, torch.rand(5, device="cuda"))
    # queries
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    assert torch.accelerator.current_accelerator() is None  # torch.optim's capture check stays on CPU
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); e1.record(); assert e0.elapsed_time(e1) >= 0.0
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    # a stand-in stream is a torch.Stream: record_stream parses it and the redirect drops the call
    # (Megatron's EP all-to-all overlap records its inputs on its communication stream)
    t = torch.ones(2, device="cuda")
    assert isinstance(torch.cuda.Stream(), torch.Stream) and t.record_stream(torch.cuda.Stream()) is None
    # backward hooks keep the redirect, however the backward was called (Megatron-FSDP allocates
    # its gradient buckets on torch.device("cuda") in post-accumulate-grad hooks)
    seen = []
    def hook(p):
        seen.append(torch.empty(2, device=torch.device("cuda")).device.type)
    w = torch.ones(3, requires_grad=True)
    w.register_post_accumulate_grad_hook(hook)
    (w * 2).sum().backward()
    torch.autograd.backward([(w * 3).sum()])
    torch.autograd.grad((w * 4).sum(), w)  # no accumulation: the hook does not run
    assert seen == ["cpu", "cpu"], seen
    # megatron-core's fused modules imported after install are not torch.compile'd
    from megatron.core import jit
    assert jit.jit_fuser is jit.noop_decorator
    device.uninstall()
    assert torch.zeros(1).type() == "torch.FloatTensor"
    import torch.autograd.graph as graph
    assert torch.autograd._engine_run_backward is graph._engine_run_backward
    assert graph._engine_run_backward.__module__ == "torch.autograd.graph"
    print("CHECKS-OK")
""")


def test_device_redirect_and_cuda_standin() -> None:
    done = subprocess.run([sys.executable, "-c", _CHECKS], capture_output=True, text=True, timeout=300,
                          env={"CUDA_VISIBLE_DEVICES": "", **__import__("os").environ})
    assert "CHECKS-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize(("name", "want"), [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                            ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H800", "h100"),
                                            ("Tesla V100", None)])
def test_device_names_map_to_constant_sets(name: str, want: str | None) -> None:
    assert hardware_for_device(name) == want


def test_hardware_rule_flag_then_device_then_default() -> None:
    hw = resolve_hardware(flag=None, device_name="NVIDIA H200", flag_gpus=None, local_world_size="8")
    assert (hw.name, hw.gpus_per_node) == ("h200", 8) and "device 'NVIDIA H200'" in hw.source
    hw = resolve_hardware(flag="h100", device_name="NVIDIA H200", flag_gpus=4, local_world_size="8")
    assert (hw.name, hw.gpus_per_node) == ("h100", 4) and "--hsap-hardware" in hw.source
    hw = resolve_hardware(flag=None, device_name="Tesla V100", flag_gpus=None, local_world_size=None)
    assert hw.name == "a100" and "pass --hsap-hardware" in hw.source and hw.gpus_per_node == 8
    with pytest.raises(ConfigError, match="--hsap-hardware b300"):
        resolve_hardware(flag="b300", device_name=None, flag_gpus=None, local_world_size=None)
    with pytest.raises(ConfigError, match="--hsap-gpus-per-node 0"):
        resolve_hardware(flag=None, device_name=None, flag_gpus=0, local_world_size=None)
