"""Megatron-LM's own ``pretrain_gpt.py``, from a checkout, run with HSAP.

``scripts/pretrain_gpt_hsap.py`` (a GPU cluster) and ``megatron-hsap pretrain-cpu --megatron-lm DIR``
(CPU gloo ranks, the same job before it takes a cluster) both call :func:`run_pretrain_gpt`: the
checkout's ``train_valid_test_datasets_provider``, ``forward_step`` (the ``ring`` path's),
``loss_func`` and ``get_embedding_ranks`` go to ``pretrain_hooks.run_pretrain`` unchanged. The
megatron-core wheel ships ``megatron/training`` but not ``pretrain_gpt.py`` (nor its
``gpt_builders.py`` / ``model_provider.py``), so it comes from the checkout (written against tag
``core_v0.19.0``).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

from megatron_hsap.errors import ConfigError

__all__ = ["MEGATRON_LM_TAG", "import_pretrain_gpt", "megatron_lm_root", "run_pretrain_gpt"]

MEGATRON_LM_TAG = "core_v0.19.0"  # the tag whose pretrain_gpt.py the hooks are written against


def megatron_lm_root(root: str | os.PathLike[str] | None = None) -> str:
    """The Megatron-LM checkout: ``root``, else ``$MEGATRON_LM``, else the working directory;
    ``ConfigError`` unless it holds ``pretrain_gpt.py``."""
    path = os.fspath(root) if root is not None else (os.environ.get("MEGATRON_LM") or os.getcwd())
    if not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        raise ConfigError(f"no pretrain_gpt.py in {path}: give a Megatron-LM checkout ({MEGATRON_LM_TAG}), "
                          "or set MEGATRON_LM=/path/to/Megatron-LM")
    return os.path.abspath(path)


def import_pretrain_gpt(root: str | os.PathLike[str] | None = None) -> ModuleType:
    """``pretrain_gpt`` of the checkout (``megatron_lm_root``); its directory goes first on
    ``sys.path`` (it imports ``gpt_builders`` and ``model_provider`` from there)."""
    path = megatron_lm_root(root)
    if path not in sys.path:
        sys.path.insert(0, path)
    import pretrain_gpt

    return pretrain_gpt


def run_pretrain_gpt(root: str | os.PathLike[str] | None = None, *, store: Any = None,
                     program_start: float | None = None) -> None:
    """``pretrain_gpt.py``'s main with HSAP's wiring (``pretrain_hooks.run_pretrain``): argument
    parsing with HSAP's flags, the HSAP spec, batch hook and groups for ``--context-parallel-impl
    hsap``, then Megatron's ``pretrain()`` with the checkout's entry points. ``store``: the
    in-process-restart store to use (the CPU command's loopback one)."""
    pretrain_gpt = import_pretrain_gpt(root)
    from megatron_hsap.megatron.pretrain_hooks import run_pretrain

    run_pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.forward_step,
        pretrain_gpt.loss_func,
        get_embedding_ranks=getattr(pretrain_gpt, "get_embedding_ranks", None),
        store=store,
        program_start=program_start,
    )
