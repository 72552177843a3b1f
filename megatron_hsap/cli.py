"""The ``megatron-hsap`` command: a dispatcher to subcommands resolved lazily from one table.

``megatron-hsap <command> [args]`` imports only the chosen command's module, so ``--help`` and
the planner commands never pay for torch or Megatron. Every target is
``main(argv: list[str] | None) -> int`` and parses its own arguments with the shared vocabulary of
:mod:`megatron_hsap.argtypes` (``--intra-size`` / ``--inter-size``, ``--out DIR``, every default in
``--help``, ``prog`` = ``megatron-hsap <command>``; ``tests/test_cli_vocabulary.py`` holds every
command to it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass

__all__ = ["COMMANDS", "Command", "main"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """One subcommand: the ``module:function`` it runs and a one-line description."""

    target: str
    summary: str


COMMANDS: dict[str, Command] = {
    "plan": Command(
        target="megatron_hsap.bench.plan_cli:main",
        summary="compile an SAP plan for a packed batch; print its stats, instructions, checks",
    ),
    "plan-quality": Command(
        target="megatron_hsap.bench.plan_quality:main",
        summary="price plans and baselines over seeded workloads (imbalance, traffic, efficiency)",
    ),
    "bench": Command(
        target="megatron_hsap.bench.cpu_attention:main",
        summary="multi-rank CPU (gloo) attention benchmark against the dense reference",
    ),
    "simulate": Command(
        target="megatron_hsap.sim.cli:main",
        summary="simulate HSAP and baselines on A100/H100 cluster models",
    ),
    "tune": Command(
        target="megatron_hsap.sim.tune:main",
        summary="choose one intra x inter topology for a run from sample batches (simulated)",
    ),
    "report": Command(
        target="megatron_hsap.sim.report:main",
        summary="regenerate the README's benchmark tables from results/*.csv",
    ),
    "train-tiny": Command(
        target="megatron_hsap.megatron.train_tiny:main",
        summary="train a tiny Megatron GPT with HSAP context parallelism on CPU ranks",
    ),
    "pretrain-cpu": Command(
        target="megatron_hsap.megatron.cpu.command:main",
        summary="run Megatron's own pretrain() loop with HSAP on CPU gloo ranks (no GPU needed)",
    ),
    "launch": Command(
        target="megatron_hsap.launch.__main__:main",
        summary="cluster launch from a YAML config: validate, topology, resolve (dry run), exec torchrun",
    ),
    "memory": Command(
        target="megatron_hsap.bench.memory_report:main",
        summary="activation and buffer-pool memory per rank for a plan",
    ),
}

_PROG = "megatron-hsap"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {_PROG} <command> [args]",
        "",
        "HSAP: hierarchical sequence-aware context parallelism for packed sequences.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()),
        "",
        f"Run '{_PROG} <command> --help' for a command's options; '{_PROG} --version' for the version.",
    ]
    return "\n".join(lines)


def _resolve(name: str) -> object:
    """Import the command's target; raise ``LookupError`` with a user-facing message if absent."""
    module_name, _, func_name = COMMANDS[name].target.partition(":")
    try:
        present = importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        present = False
    if not present:
        raise LookupError(
            f"{_PROG} {name}: not available in this installation "
            f"(module {module_name} is not present yet)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or "a dependency"
        raise LookupError(
            f"{_PROG} {name}: needs the Python package '{missing}', which is not installed; "
            f"install the test extra: pip install -e '.[test]' (or run: bash scripts/setup.sh)"
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise LookupError(f"{_PROG} {name}: {module_name} has no callable {func_name}()")
    return func


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; return its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from megatron_hsap import __version__

        print(f"{_PROG} {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"{_PROG}: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        print(f"Run '{_PROG} --help' for what each does.", file=sys.stderr)
        return 2
    try:
        func = _resolve(name)
    except LookupError as exc:
        print(exc, file=sys.stderr)
        return 1
    code = func(rest)  # type: ignore[operator]
    return 0 if code is None else int(code)


if __name__ == "__main__":
    raise SystemExit(main())
