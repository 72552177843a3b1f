#!/usr/bin/env python
"""Megatron-LM's ``pretrain_hybrid.py`` with ``--context-parallel-impl {ring,hsap}`` (GPU clusters).

Hybrid models — ``--hybrid-layer-pattern`` of Mamba (``M``, Nemotron-H), gated delta net (``G``,
Qwen3-Next), attention (``*``), MLP (``-``) and MoE (``E``) layers — through Megatron's own
``pretrain()`` loop, data pipeline, loss function and checkpointing, as ``pretrain_gpt_hsap.py`` does
for a GPT (the same wiring; see that script): with ``--context-parallel-impl hsap`` HSAP's hybrid
stack spec (``--spec`` is set for you: HSAP attention, Mamba mixer and gated delta net), HSAP batch
sharding in ``forward_step`` and ``initialize_hsap`` after Megatron's initialisation. With ``ring``
(the default) it is exactly ``pretrain_hybrid.py``.

Written against Megatron-LM tag ``core_v0.19.0``. Run it from a Megatron-LM checkout (it imports
``pretrain_hybrid`` and ``hybrid_builders`` from there)::

    cd Megatron-LM
    torchrun --nproc-per-node 8 --nnodes 2 ... /path/to/megatron-hsap/scripts/pretrain_hybrid_hsap.py \\
        <your pretrain_hybrid.py flags> --hybrid-layer-pattern "M*M-M*M-" --context-parallel-size 16 \\
        --context-parallel-impl hsap --hierarchical-context-parallel-sizes 8 2 \\
        --calculate-per-token-loss --attention-dropout 0.0 --dataloader-inter-document-masking

``MEGATRON_LM=/path/to/Megatron-LM`` works too. The same job on CPU ranks:
``megatron-hsap pretrain-cpu --megatron-lm /path/to/Megatron-LM -- --hybrid-layer-pattern ...``
(this script's very function). Mamba layers need ``mamba_ssm`` and ``causal_conv1d`` on the cluster,
gated delta net layers ``flash-linear-attention``.
"""

from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()


def main() -> None:
    from megatron_hsap.megatron.megatron_lm import HYBRID, script_main

    script_main(HYBRID, program_start=_PROGRAM_START_TIME)


if __name__ == "__main__":
    main()
