"""Run a *patched* Megatron-LM checkout's own ``pretrain_gpt.py`` / ``pretrain_hybrid.py`` as
``__main__`` on CPU gloo ranks — the check behind docs/enable.md "Path 2" (CI has no checkout).

Each rank puts the checkout first on ``sys.path`` (its own ``megatron`` package, megatron-core
0.19.0 source), installs the CPU device shim (``megatron/cpu/device.py``: CUDA calls redirected,
the ``mamba_ssm`` / ``fla`` stand-ins) and the CPU rank's two norm substitutions, hands
``init_process_group`` a loopback file store (nothing listens on a port), takes the C++ dataset
helpers prebuilt (copy the wheel's ``helpers_cpp*.so`` into the checkout's
``megatron/core/datasets/``; its Makefile would build them with the system Python), and runs the
script. The flags are ``pretrain-cpu``'s (``cpu/command.py``: the CPU corpus, NullTokenizer) plus
the ones given; ``ring`` runs drop HSAP's CP flags (CP=1, Megatron's own path).

    cd Megatron-LM && git checkout core_v0.19.0 && git apply /path/to/megatron-hsap/patches/*.patch
    cp /path/to/venv/lib/python3.13/site-packages/megatron/core/datasets/helpers_cpp*.so megatron/core/datasets/
    cd /path/to/megatron-hsap
    PYTHONPATH=. .venv/bin/python docs/experiments/patched_checkout_cpu.py $MEGATRON_LM/pretrain_hybrid.py \\
        --world-size 4 --intra-size 2 --inter-size 2 --out /tmp/h -- --hybrid-layer-pattern M-M- --mamba-head-dim 8 \\
        --mamba-num-groups 4 --mamba-state-dim 16 --no-hsap-layout-fallback
    PYTHONPATH=. .venv/bin/python docs/experiments/patched_checkout_cpu.py $MEGATRON_LM/pretrain_hybrid.py \\
        --ring --out /tmp/r -- --hybrid-layer-pattern M-M- --mamba-head-dim 8 --mamba-num-groups 4 \\
        --mamba-state-dim 16 --spec megatron_hsap.megatron.cpu.reference_spec REFERENCE_HYBRID_STACK_SPEC

Each prints the exit codes and the per-step training and validation losses of the last rank.
``--no-documents`` drops ``--dataloader-inter-document-masking`` (no ``cu_seqlens``: the scans run
across documents), the mutation that shows the comparison can fail.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys


def _rank(script: str, flags: list[str]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    sys.argv = [script, *flags]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_hsap.megatron.cpu import device
    from megatron_hsap.megatron.cpu import rank as cpu_rank

    device.install()
    cpu_rank.without_te()
    store = dist.FileStore(os.environ["HSAP_CPU_STORE"], int(os.environ["WORLD_SIZE"]))
    init = dist.init_process_group

    def init_with_store(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        kwargs.pop("init_method", None)
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        return init(*args, **kwargs)

    dist.init_process_group = init_with_store
    import megatron.core
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (copied in: see the docstring)
    from megatron.core.datasets import utils as dataset_utils

    print(f"[patched_checkout_cpu] megatron from {os.path.dirname(megatron.core.__file__)}", flush=True)
    dataset_utils.compile_helpers = lambda: None
    runpy.run_path(script, run_name="__main__")
    if dist.is_initialized():
        dist.destroy_process_group()


def flags(script: str, *, world_size: int = 1, intra_size: int = 1, inter_size: int = 1, ring: bool = False,
          no_documents: bool = False, extra: tuple[str, ...] = ()) -> list[str]:
    """The script's Megatron flags: ``pretrain-cpu``'s for this run (``cpu/command.py``: model, CPU
    corpus, NullTokenizer, HSAP's CP flags); ``ring``: CP=1 under ``--context-parallel-impl ring``."""
    from megatron_hsap.megatron.cpu.command import CPURun, corpus_data_flags, megatron_flags

    run = CPURun(world_size=world_size, intra_size=intra_size, inter_size=inter_size,
                 megatron_lm=os.path.dirname(os.path.abspath(script)), extra=tuple(extra))
    out = megatron_flags(run) + corpus_data_flags(run)
    if ring:
        out[out.index("--context-parallel-impl") + 1] = "ring"
        for flag, values in (("--context-parallel-size", 1), ("--hierarchical-context-parallel-sizes", 2)):
            i = out.index(flag)
            del out[i:i + 1 + values]
    if no_documents:
        out.remove("--dataloader-inter-document-masking")
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        return _rank(sys.argv[2], sys.argv[3:])
    from megatron_hsap.megatron.cpu.command import parse_log, rank_env

    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("script")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--intra-size", type=int, default=1)
    p.add_argument("--inter-size", type=int, default=1)
    p.add_argument("--ring", action="store_true", help="Megatron's own CP path at CP=1 (HSAP's flags dropped)")
    p.add_argument("--no-documents", action="store_true")
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    argv_flags = flags(ns.script, world_size=ns.world_size, intra_size=ns.intra_size, inter_size=ns.inter_size,
                       ring=ns.ring, no_documents=ns.no_documents, extra=tuple(extra))
    os.makedirs(ns.out, exist_ok=True)
    argv_flags += ["--data-cache-path", os.path.join(ns.out, "index-cache")]
    store = os.path.join(ns.out, "store")
    if os.path.exists(store):
        os.remove(store)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", ns.script, *argv_flags],
                              env=rank_env(r, ns.world_size, store), stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              stdout=open(os.path.join(ns.out, f"rank{r}.log"), "w"))
             for r in range(ns.world_size)]
    codes = [proc.wait(timeout=900) for proc in procs]
    with open(os.path.join(ns.out, f"rank{ns.world_size - 1}.log")) as f:
        losses, validation, _ = parse_log(f.read())
    print(json.dumps(dict(exit_codes=codes, losses=losses, validation=validation)))


if __name__ == "__main__":
    main()
