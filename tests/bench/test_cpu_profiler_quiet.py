"""The CPU benchmark's memory probe prints nothing: kineto (torch.profiler) probes CUDA in every
rank and logs ``gpuGetDeviceCount failed with code 35`` plus start/stop lines on a CPU machine,
which read like failures (issue 19). ``_peak_alloc`` mutes kineto's logger unless the user set
``KINETO_LOG_LEVEL``, and still measures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import torch
from megatron_hsap.bench.cpu_attention import _peak_alloc
peak = _peak_alloc(lambda: torch.ones(1 << 20) * 2)   # 4 MiB each: input and result
print(peak)
"""


def _probe(**env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    full.update(CUDA_VISIBLE_DEVICES="", **env)  # a CPU machine, even on a GPU host
    return subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=300)


def test_memory_probe_is_quiet_and_still_measures() -> None:
    out = _probe()
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no kineto lines at all
    assert int(out.stdout) >= 2 * 4 * (1 << 20)  # both 4 MiB tensors were live at the peak


@pytest.mark.slow  # the control: kineto does print here when asked (another torch start)
def test_a_user_kineto_log_level_wins() -> None:
    out = _probe(KINETO_LOG_LEVEL="0")  # verbose: the user asked for kineto's diagnostics
    assert out.returncode == 0 and "profiler_start" in out.stderr
