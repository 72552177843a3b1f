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

``MEGATRON_LM=/path/to/Megatron-LM`` works too. GPU only: ``pretrain()`` needs CUDA.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

_PROGRAM_START_TIME = time.time()


def _megatron_lm_root() -> str:
    root = os.environ.get("MEGATRON_LM") or os.getcwd()
    if not os.path.exists(os.path.join(root, "pretrain_gpt.py")):
        raise SystemExit(
            f"pretrain_gpt_hsap.py: no pretrain_gpt.py in {root}; run from a Megatron-LM checkout "
            "(core_v0.19.0) or set MEGATRON_LM=/path/to/Megatron-LM"
        )
    return root


def extra_args_provider(parser: Any) -> Any:
    """Megatron's own extra arguments (ModelOpt when installed) plus HSAP's."""
    from megatron_hsap.megatron.arguments import add_hsap_args

    try:
        from megatron.post_training.arguments import add_modelopt_args

        parser = add_modelopt_args(parser)
    except ImportError:
        pass
    return add_hsap_args(parser)


def main() -> None:
    sys.path.insert(0, _megatron_lm_root())
    main_entry = time.time()
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_hsap.megatron.pretrain_hooks import hsap_entry_points

    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=main_entry)
    setattr(pretrain_gpt.train_valid_test_datasets_provider, "is_distributed", True)
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    args = parse_and_validate_args(extra_args_provider=extra_args_provider,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    provider, forward_step = pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step
    if args.context_parallel_impl == "hsap":  # validates the flags, sets args.spec to the HSAP spec
        provider, forward_step = hsap_entry_points(args, provider, pretrain_gpt.loss_func)
    model_cfg = gpt_config_from_args(args)
    run(
        pretrain_cfg_container_from_args(args, model_cfg),
        provider,
        ModelType.encoder_or_decoder,
        forward_step,
        store=store,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
