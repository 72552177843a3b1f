#!/usr/bin/env python
"""Megatron-LM's ``pretrain_gpt.py`` with ``--context-parallel-impl {ring,hsap}`` (GPU clusters).

Runs Megatron's own ``pretrain()`` loop, data pipeline, loss function and checkpointing; with
``--context-parallel-impl hsap`` it swaps in HSAP's layer spec (``--spec`` is set for you), HSAP
batch sharding in ``forward_step`` and ``initialize_hsap`` after Megatron's initialisation. With
``ring`` (the default) it is exactly ``pretrain_gpt.py``.

Written against Megatron-LM tag ``core_v0.19.0`` (commit 5be9626709af2722333bf54797c954c09edeada3,
whose ``megatron/training/arguments.py`` is byte-identical to the megatron-core 0.19.2 wheel's).
Run it from a Megatron-LM checkout (it imports ``pretrain_gpt`` from there)::

    cd Megatron-LM
    torchrun --nproc-per-node 8 --nnodes 2 ... /path/to/megatron-hsap/scripts/pretrain_gpt_hsap.py \\
        <your pretrain_gpt.py flags> --context-parallel-size 16 \\
        --context-parallel-impl hsap --hierarchical-context-parallel-sizes 8 2 \\
        --calculate-per-token-loss --attention-dropout 0.0 --dataloader-inter-document-masking

``MEGATRON_LM=/path/to/Megatron-LM`` works too. To try the same loop without a GPU (and without a
Megatron-LM checkout), run ``megatron-hsap pretrain-cpu``.
"""

from __future__ import annotations

import os
import sys
import time

_PROGRAM_START_TIME = time.time()


def _megatron_lm_root() -> str:
    root = os.environ.get("MEGATRON_LM") or os.getcwd()
    if not os.path.exists(os.path.join(root, "pretrain_gpt.py")):
        raise SystemExit(
            f"pretrain_gpt_hsap.py: no pretrain_gpt.py in {root}; run from a Megatron-LM checkout "
            "(core_v0.19.0) or set MEGATRON_LM=/path/to/Megatron-LM"
        )
    return root


def main() -> None:
    sys.path.insert(0, _megatron_lm_root())
    import pretrain_gpt

    from megatron_hsap.megatron.pretrain_hooks import run_pretrain

    # The wiring (argument parsing with HSAP's flags, ModelOpt, the HSAP spec, batch hook and groups,
    # pretrain()) is the one function the CPU command `megatron-hsap pretrain-cpu` runs too.
    run_pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.forward_step,
        pretrain_gpt.loss_func,
        get_embedding_ranks=getattr(pretrain_gpt, "get_embedding_ranks", None),
        program_start=_PROGRAM_START_TIME,
    )


if __name__ == "__main__":
    main()
