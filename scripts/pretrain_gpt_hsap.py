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

``MEGATRON_LM=/path/to/Megatron-LM`` works too. To try the same loop without a GPU, run
``megatron-hsap pretrain-cpu`` (its own copies of pretrain_gpt's provider and loss, no checkout), or
``megatron-hsap pretrain-cpu --megatron-lm /path/to/Megatron-LM`` (this script's very function, on
CPU ranks). Hybrid models (``--hybrid-layer-pattern``: Mamba, gated delta net layers) go through
``pretrain_hybrid_hsap.py``, Megatron-LM's ``pretrain_hybrid.py`` with the same wiring; given a
pattern, this script says so before anything runs.
"""

from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()


def main() -> None:
    from megatron_hsap.megatron.megatron_lm import GPT, script_main

    # The wiring (argument parsing with HSAP's flags, ModelOpt, the HSAP spec, batch hook and groups,
    # pretrain() with the checkout's provider, forward step and loss) is the one function
    # `megatron-hsap pretrain-cpu --megatron-lm DIR` runs too, on CPU ranks.
    script_main(GPT, program_start=_PROGRAM_START_TIME)


if __name__ == "__main__":
    main()
