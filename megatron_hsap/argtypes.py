"""The command-line vocabulary shared by every ``megatron-hsap`` command (``plan``, ``plan-quality``,
``bench``, ``simulate``, ``tune``, ``report``, ``train-tiny``, ``memory``, ``pretrain-cpu``,
``launch``): argparse ``type=`` callables — a bad value is an argparse error, one line naming the
flag, exit status 2, before anything runs, never a traceback or an absurd table —, the help
formatter that shows every default, the topology flags ``--intra-size`` / ``--inter-size`` with
their deprecated aliases, the one-line statement of the link the planner prices, and reading a
flag's value out of Megatron arguments passed through (``flag_value``).

Standard library only (``link_line`` imports the planner's pure-Python hardware table when called),
so any layer above ``plan`` may import it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "port", "writable_file",
           "output_dir", "given_options", "HelpFormatter", "DeprecatedAlias", "add_renamed", "add_topology_args", "link_line", "flag_value",
           "flag_names"]


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return value


def nonnegative_int(text: str) -> int:
    """An integer ≥ 0."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number ≥ 0."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return value


def port(text: str) -> int:
    """A TCP port 1..65535."""
    value = int(_number(text, int))
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: use 1..65535")
    return value


def writable_file(text: str) -> Path:
    """An output path whose directory exists (or can be created) and is writable."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is not writable")
    _check_folder_can_hold(text, path.parent if str(path.parent) else Path("."))
    return path


def output_dir(text: str) -> Path:
    """An output folder (``--out DIR``): created when missing; an existing file is refused."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; --out takes a folder (files are written inside it)")
    _check_folder_can_hold(text, path)
    return path


def _check_folder_can_hold(text: str, folder: Path) -> None:
    """Raise ``ArgumentTypeError`` unless ``folder`` exists or can be made, and written into: its
    nearest existing ancestor is a folder, writable, and takes a new entry (what ``access()``
    cannot tell — root on /proc, a read-only mount — a folder made there and removed tells)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {probe} is a file")
    if not os.access(probe, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {probe} is not writable")
    try:
        tempfile.TemporaryDirectory(dir=probe, prefix=".hsap-probe-").cleanup()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {probe}: {exc.strerror or exc}") from None


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations of the options ``argv`` gives, to tell a value given from a default:
    ``parser`` (a fresh one, built for this: its defaults are suppressed in place) parses ``argv``
    again. Aliases count under their destination; argparse's prefix abbreviations are resolved."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


# --------------------------------------------------------------------------- the shared vocabulary
#
# One spelling per concept in every ``megatron-hsap`` command: ``--intra-size`` / ``--inter-size``
# for the topology (as ``train-tiny`` and ``pretrain-cpu``; Megatron's own flag is
# ``--hierarchical-context-parallel-sizes P_intra P_inter``), ``--out DIR`` for an output folder,
# every default in ``--help``. Old spellings stay accepted as hidden aliases that print one note.


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with every option's default: ``(default: X)`` appended unless the help already
    states it; on/off flags (``store_true``) are off by default and say nothing. Descriptions and
    epilogs keep their line breaks (command examples)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default is argparse.SUPPRESS or action.nargs == 0 or not action.option_strings
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class DeprecatedAlias(argparse.Action):
    """A hidden old spelling: stores like the new flag, prints one deprecation line on stderr."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: object) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: note: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_renamed(parser: argparse.ArgumentParser | argparse._ArgumentGroup, new: str, *old: str,
                **kwargs: object) -> argparse.Action:
    """``parser.add_argument(new, **kwargs)`` plus hidden deprecated aliases ``old`` (same dest,
    type, nargs and choices) that print ``note: --old is deprecated, use --new``."""
    action = parser.add_argument(new, **kwargs)  # type: ignore[arg-type]
    for name in old:
        parser.add_argument(name, dest=action.dest, action=DeprecatedAlias, new=new, type=action.type,
                            nargs=action.nargs, choices=action.choices, default=argparse.SUPPRESS,
                            metavar=action.metavar, help=argparse.SUPPRESS)
    return action


def add_topology_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, intra: object = 1,
                      inter: object = 8, nargs: str | None = None, old: bool = True) -> None:
    """``--intra-size`` (P_intra: the all-to-all group inside a node) and ``--inter-size``
    (P_inter: the SAP point-to-point group); ``old`` keeps ``--intra`` / ``--inter`` as
    deprecated aliases. ``nargs="+"`` for commands that sweep sizes."""
    many = "values" if nargs else "size"
    add_renamed(parser, "--intra-size", *(["--intra"] if old else []), type=positive_int, default=intra,
                nargs=nargs, metavar="P_INTRA",
                help=f"P_intra {many}: the Ulysses all-to-all group inside one node")
    add_renamed(parser, "--inter-size", *(["--inter"] if old else []), type=positive_int, default=inter,
                nargs=nargs, metavar="P_INTER",
                help=f"P_inter {many}: the SAP point-to-point group")


def link_line(*, intra: int, inter: int, tp: int = 1, gpus_per_node: int = 8, forced: str | None = None,
              measured: str | None = None) -> str:
    """One line naming the link class the planner prices and why (docs/design.md §4's rule,
    ``plan.hardware.link_class_for``: NVLink when the whole CP group TP × P_intra × P_inter fits in
    one node, InfiniBand otherwise); ``forced``: a ``--link`` given on the command line;
    ``measured``: the link a Megatron run read from its ranks' hostnames (``HSAPGroups.cp_link``)."""
    from megatron_hsap.plan.hardware import LinkClass, link_class_for

    world = tp * intra * inter
    if forced:
        return f"link {LinkClass(forced).value} (forced by --link; the rule would give {link_class_for(world, gpus_per_node).value})"
    if measured:
        rule = link_class_for(world, gpus_per_node).value
        where = "on one host" if LinkClass(measured) is LinkClass.NVLINK else "across hosts"
        note = "" if rule == LinkClass(measured).value else (
            f"; the {gpus_per_node}-GPUs-per-node rule would have given {rule}")
        return f"link {LinkClass(measured).value}: the CP group's {world // tp} ranks run {where} (hostnames){note}"
    link = link_class_for(world, gpus_per_node)
    where = "fits in" if link is LinkClass.NVLINK else "spans more than"
    return (f"link {link.value}: the CP group TP {tp} × P_intra {intra} × P_inter {inter} = {world} GPUs "
            f"{where} one {gpus_per_node}-GPU node (docs/design.md §4)")


def flag_names(args: Sequence[str]) -> set[str]:
    """The flags given in command-line ``args``, either spelling (``--flag V`` or ``--flag=V``): what
    Megatron's argparse parser reads from arguments passed through (e.g. after ``--``)."""
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def flag_occurrences(args: Sequence[str], flag: str) -> list[list[str]]:
    """The values given to a many-valued (``nargs="+"``) ``flag`` in command-line ``args``, one list
    per occurrence in order: ``--flag A B`` (the values up to the next flag) or ``--flag=A``.
    argparse keeps the last occurrence; a check of every one sees them all."""
    args = list(args)
    out = []
    for i, a in enumerate(args):
        if a == flag:
            out.append(list(itertools.takewhile(lambda v: not v.startswith("--"), args[i + 1:])))
        elif a.startswith(flag + "="):
            out.append([a.split("=", 1)[1]])
    return out


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` in command-line ``args`` (``--flag V`` or ``--flag=V``), None when
    absent (Megatron arguments passed through, e.g. after ``--``). A flag given twice has its *last*
    value, as Megatron's argparse parser (``allow_abbrev=False``: the exact flag only) keeps it."""
    args = list(args)
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value
