"""Megatron-LM's own ``pretrain_gpt.py`` and ``pretrain_hybrid.py``, from a checkout, run with HSAP.

``scripts/pretrain_gpt_hsap.py`` / ``scripts/pretrain_hybrid_hsap.py`` (a GPU cluster) and
``megatron-hsap pretrain-cpu --megatron-lm DIR`` (CPU gloo ranks, the same job before it takes a
cluster) all call :func:`run_megatron_lm`: the checkout's ``train_valid_test_datasets_provider``,
``forward_step`` (the ``ring`` path's), ``loss_func`` and ``get_embedding_ranks`` (pretrain_gpt's
only) go to ``pretrain_hooks.run_pretrain`` unchanged. ``pretrain_gpt.py`` builds a ``GPTModel``;
``pretrain_hybrid.py`` (``pretrain_mamba.py`` before it) a ``HybridModel`` from
``--hybrid-layer-pattern`` — Mamba, gated delta net, attention, MLP and MoE layers. The megatron-core
wheel ships ``megatron/training`` but neither script (nor their ``gpt_builders.py`` /
``hybrid_builders.py`` / ``model_provider.py``), so they come from the checkout (written against tag
``core_v0.19.0``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from megatron_hsap.argtypes import flag_names
from megatron_hsap.errors import ConfigError

__all__ = ["GPT", "HYBRID", "HYBRID_FLAGS", "MEGATRON_LM_TAG", "SCRIPTS", "WRAPPERS", "check_entry", "entry_for", "import_entry",
           "megatron_lm_root", "run_megatron_lm", "script_main"]

MEGATRON_LM_TAG = "core_v0.19.0"  # the tag whose scripts the hooks are written against
GPT, HYBRID = "pretrain_gpt", "pretrain_hybrid"  # the checkout's entry modules
# Megatron's flags that make a hybrid model (validate_args turns the deprecated two into the first)
HYBRID_FLAGS = ("--hybrid-layer-pattern", "--hybrid-override-pattern", "--mtp-hybrid-override-pattern")
# this project's wrapper script of each (relative to the repository; the SLURM launcher's entries)
SCRIPTS = {GPT: "scripts/pretrain_gpt_hsap.py", HYBRID: "scripts/pretrain_hybrid_hsap.py"}
WRAPPERS = f"{SCRIPTS[GPT]} ({SCRIPTS[HYBRID]} for hybrid models)"  # what error messages point to


def entry_for(argv: Sequence[str]) -> str:
    """The checkout's entry module for Megatron flags ``argv``: ``pretrain_hybrid`` when they give a
    hybrid layer pattern (``HYBRID_FLAGS``, ``--flag V`` or ``--flag=V``), else ``pretrain_gpt``."""
    return HYBRID if flag_names(argv) & set(HYBRID_FLAGS) else GPT


def megatron_lm_root(root: str | os.PathLike[str] | None = None, entry: str = GPT) -> str:
    """The Megatron-LM checkout: ``root``, else ``$MEGATRON_LM``, else the working directory;
    ``ConfigError`` unless it holds ``{entry}.py``."""
    path = os.fspath(root) if root is not None else (os.environ.get("MEGATRON_LM") or os.getcwd())
    if not os.path.isfile(os.path.join(path, f"{entry}.py")):
        raise ConfigError(f"no {entry}.py in {path}: give a Megatron-LM checkout ({MEGATRON_LM_TAG}), "
                          "or set MEGATRON_LM=/path/to/Megatron-LM")
    return os.path.abspath(path)


def import_entry(root: str | os.PathLike[str] | None = None, entry: str = GPT) -> ModuleType:
    """The checkout's ``entry`` module (``megatron_lm_root``); its directory goes first on ``sys.path``
    (the scripts import ``gpt_builders`` / ``hybrid_builders`` and ``model_provider`` from there)."""
    import importlib

    path = megatron_lm_root(root, entry)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(entry)


def check_entry(entry: str, argv: Sequence[str]) -> None:
    """``ConfigError`` when Megatron flags ``argv`` are for the other script: a hybrid layer pattern
    given to ``pretrain_gpt`` (Megatron's would build a GPTModel and ignore it), or none given to
    ``pretrain_hybrid`` (it has no model to build)."""
    if entry not in SCRIPTS:
        raise ConfigError(f"entry {entry!r}: one of {', '.join(SCRIPTS)}")
    wanted = entry_for(argv)
    if wanted == entry:
        return
    if entry == GPT:
        given = sorted(flag_names(argv) & set(HYBRID_FLAGS))
        raise ConfigError(f"{', '.join(given)}: Megatron-LM trains hybrid models with pretrain_hybrid.py "
                          f"(pretrain_gpt.py builds a GPTModel and ignores the pattern): run {SCRIPTS[HYBRID]}")
    raise ConfigError(f"pretrain_hybrid.py builds a HybridModel from --hybrid-layer-pattern, and none was given: "
                      f"give one, or run {SCRIPTS[GPT]} for a GPT")


def run_megatron_lm(root: str | os.PathLike[str] | None = None, entry: str | None = None, *, store: Any = None,
                    program_start: float | None = None) -> None:
    """The checkout's ``pretrain_gpt.py`` or ``pretrain_hybrid.py`` main (``entry``; by default
    ``entry_for`` this process's arguments) with HSAP's wiring (``pretrain_hooks.run_pretrain``):
    argument parsing with HSAP's flags, the HSAP spec, batch hook and groups for
    ``--context-parallel-impl hsap``, then Megatron's ``pretrain()`` with the checkout's entry points
    and the script's model (GPTModel / HybridModel). ``store``: the in-process-restart store to use
    (the CPU command's loopback one). ``ConfigError`` before anything runs when the flags are for the
    other script (``check_entry``) or the checkout lacks it."""
    argv = sys.argv[1:]
    entry = entry or entry_for(argv)
    check_entry(entry, argv)
    module = import_entry(root, entry)
    from megatron_hsap.megatron.pretrain_hooks import run_pretrain

    run_pretrain(
        module.train_valid_test_datasets_provider,
        module.forward_step,
        module.loss_func,
        get_embedding_ranks=getattr(module, "get_embedding_ranks", None),
        store=store,
        program_start=program_start,
        hybrid=entry == HYBRID,
    )


def script_main(entry: str, *, program_start: float | None = None) -> None:
    """``scripts/pretrain_{gpt,hybrid}_hsap.py``: ``run_megatron_lm`` for ``entry`` with this
    process's arguments; a missing checkout or flags for the other script exit with one line naming
    the script and what to change (``SystemExit``, before anything runs)."""
    script = os.path.basename(SCRIPTS[entry])
    try:
        root = megatron_lm_root(entry=entry)
        check_entry(entry, sys.argv[1:])
    except ConfigError as exc:
        raise SystemExit(f"{script}: {exc}") from None
    run_megatron_lm(root, entry, program_start=program_start)
