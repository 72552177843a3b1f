"""YAML → ``LaunchConfig``: ``extends`` chains, deep merge, unknown-key and type checks.

``extends: base.yaml`` (relative to the file) is read first and the file's own keys are merged
over it (mappings merge, everything else replaces). Unknown keys raise ``ConfigError`` with the
closest known key; ``seq_length`` also takes ``"128K"`` / ``"1M"``. ``megatron_args`` (and the
command line's arguments after ``--``, ``with_megatron_args``) are checked against the sections
by ``check_passthrough``, which ``LaunchConfig``'s validation calls.
"""

from __future__ import annotations

import difflib
import enum
import re
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from megatron_hsap.argtypes import flag_names, flag_occurrences
from megatron_hsap.errors import ConfigError
from megatron_hsap.launch.config import (
    CPImpl,
    ClusterConfig,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    parse_tokens,
)

__all__ = ["load_config", "config_from_dict", "with_megatron_args", "check_passthrough", "default_entry"]


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "parallel": ParallelConfig, "cluster": ClusterConfig,
    "training": TrainingConfig, "data": DataConfig,
}
_TOP_KEYS = set(_SECTIONS) | {"name", "megatron_args", "entry", "extends", "description", "untested"}
_TOKEN_FIELDS = {"seq_length"}


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> LaunchConfig:
    """Read a YAML config (following ``extends``), apply ``overrides`` and validate it."""
    path = Path(path)
    data = _read_with_bases(path, ())
    if overrides:
        data = _merge(data, dict(overrides))
    data.setdefault("name", path.stem)
    return config_from_dict(data, source=str(path))


def _read_with_bases(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    import yaml

    path = path.resolve()
    if path in chain:
        raise ConfigError(f"extends: cycle {' -> '.join(str(p) for p in chain + (path,))}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: extends must be one relative file name, got {base!r}")
    return _merge(_read_with_bases(path.parent / base, chain + (path,)), data)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def config_from_dict(data: Mapping[str, Any], *, source: str | None = None) -> LaunchConfig:
    """Build a ``LaunchConfig`` from plain data (what ``yaml.safe_load`` returns)."""
    _unknown(set(data), _TOP_KEYS, "")
    for key in ("model", "cluster", "training"):
        if key not in data:
            raise ConfigError(f"{key}: section missing{f' in {source}' if source else ''}")
    sections = {}
    for key, cls in _SECTIONS.items():
        raw = data.get(key) or {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{key}: must be a mapping, got {type(raw).__name__}")
        if key == "parallel":
            raw = _parallel_aliases(dict(raw))
        sections[key] = _build(cls, raw, key)
    extra = data.get("megatron_args") or []
    if isinstance(extra, str):
        extra = shlex.split(extra)
    if not isinstance(extra, list) or not all(isinstance(a, (str, int, float)) for a in extra):
        raise ConfigError("megatron_args: must be a list of command-line tokens")
    return LaunchConfig(name=str(data.get("name", "config")), megatron_args=tuple(str(a) for a in extra),
                        entry=str(data.get("entry", default_entry(extra))), untested=_untested(data.get("untested")),
                        source=source, **sections)


def default_entry(megatron_args: Sequence[Any]) -> str:
    """The entry script when the config names none: ``pretrain_hybrid_hsap.py`` for a hybrid layer
    pattern in ``megatron_args`` (Megatron-LM builds hybrid models with ``pretrain_hybrid.py``),
    else ``DEFAULT_ENTRY`` (``pretrain_gpt_hsap.py``): ``megatron_lm.SCRIPTS``."""
    from megatron_hsap.megatron.megatron_lm import SCRIPTS, entry_for

    return SCRIPTS[entry_for([str(a) for a in megatron_args])]


def with_megatron_args(cfg: LaunchConfig, extra: Sequence[str]) -> LaunchConfig:
    """``cfg`` with the command line's arguments after ``--`` appended to its ``megatron_args`` (they
    follow them on the entry point's command line), validated again (``check_passthrough``), so
    the preflight and the argument list see them too."""
    if not extra:
        return cfg
    try:
        return replace(cfg, megatron_args=(*cfg.megatron_args, *extra))  # (__post_init__ validates)
    except ConfigError as err:
        raise ConfigError(f"the arguments after -- (appended to the config's {err})") from None


def check_passthrough(cfg: LaunchConfig) -> None:
    """``megatron_args`` may repeat Megatron's hierarchical CP flag; it must agree with ours, at every
    occurrence (argparse keeps the last one). Flags the config sections own are refused in either
    spelling (``--flag V`` or ``--flag=V``): argparse reads both, so either would silently win.
    Under HSAP, CUDA graphs that would capture its layers are refused (``megatron/cuda_graphs.py``).
    Part of ``LaunchConfig``'s validation (``config._validate_launch``)."""
    args = list(cfg.megatron_args)
    flag = "--hierarchical-context-parallel-sizes"
    want = [cfg.parallel.hsap_intra_size, cfg.parallel.hsap_inter_size]
    for given in flag_occurrences(args, flag):
        try:
            sizes = [int(v) for v in given]
        except ValueError:
            sizes = []
        if sizes != want:
            raise ConfigError(
                f"megatron_args: {flag} {' '.join(given)} contradicts parallel.hsap_intra_size × "
                f"hsap_inter_size = {want[0]}x{want[1]}; drop the flag or fix it")
    owned = {"--context-parallel-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
             "--seq-length", "--context-parallel-impl", "--hsap-layout", "--hsap-pool-bytes",
             # the data: section (a second --data-path would silently win over data.data_path)
             "--data-path", "--mock-data", "--split", "--tokenizer-type", "--tokenizer-model",
             "--vocab-file", "--merge-file"}
    given = flag_names(args)
    clash = sorted(owned & given)
    if clash:
        raise ConfigError(f"megatron_args: {clash} are set from the config sections; change them there")
    if cfg.parallel.cp_impl is CPImpl.HSAP and "--cp-comm-type" in given:  # (a ring config may pick TE's type)
        raise ConfigError("megatron_args: --cp-comm-type selects Transformer Engine's context-parallel algorithm, "
                          "which parallel.cp_impl hsap replaces (its split is hsap_intra_size × hsap_inter_size); "
                          "drop it")
    from megatron_hsap.megatron.cuda_graphs import argv_cuda_graphs, cuda_graph_problem  # (Megatron's rule, one home)

    if cfg.parallel.cp_impl is CPImpl.HSAP and (graphs := cuda_graph_problem(*argv_cuda_graphs(args))) is not None:
        raise ConfigError(f"megatron_args: {graphs}")
    if "--sft" in given and cfg.data.reset_position_ids:  # (the data: section adds --reset-position-ids)
        raise ConfigError("megatron_args: --sft, but data.reset_position_ids is true: Megatron's SFTDataset gives each "
                          "conversation its own positions and asserts --reset-position-ids off; set "
                          "data.reset_position_ids: false")
    _check_entry(cfg)
    hsap_only = sorted(a for a in given if a.startswith(("--hsap-", "--no-hsap-")))
    if cfg.parallel.cp_impl is not CPImpl.HSAP and hsap_only:
        raise ConfigError(f"megatron_args: {hsap_only} configure HSAP, but parallel.cp_impl is {cfg.parallel.cp_impl.value}, "
                          "which ignores them; drop them or set parallel.cp_impl: hsap")


def _check_entry(cfg: LaunchConfig) -> None:
    """This project's entry scripts refuse the other one's model at start-up (``megatron_lm.check_entry``):
    say so when the config is read instead (a custom entry is the user's business)."""
    from megatron_hsap.megatron.megatron_lm import SCRIPTS, check_entry

    entry = {Path(script).name: name for name, script in SCRIPTS.items()}.get(Path(cfg.entry).name)
    if entry is None:
        return
    try:
        check_entry(entry, cfg.megatron_args)
    except ConfigError as err:
        raise ConfigError(f"entry {cfg.entry} with these megatron_args: {err} (or drop entry: the default "
                          "follows the layer pattern)") from None


def _untested(value: Any) -> tuple[str, ...]:
    """The ``untested:`` list: names of ``preflight.Feature`` (checked against use at launch)."""
    from megatron_hsap.launch.preflight import NOW_TESTED, Feature

    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, list):
        raise ConfigError(f"untested: expected a list of feature names, got {value!r}")
    known = [f.value for f in Feature]
    for name in value:
        if name in NOW_TESTED:
            raise ConfigError(f"untested: {name!r} is tested now ({NOW_TESTED[name]}); remove it from the list")
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            raise ConfigError(f"untested: {name!r} is not a feature name"
                              f"{f'; did you mean {close[0]}?' if close else ''} (known: {known})")
    return tuple(value)


def _parallel_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """Accept Megatron's spelling ``hierarchical_context_parallel_sizes: [P_intra, P_inter]``, and
    a bare ``context: P`` for the ring baseline (a flat group: 1 × P)."""
    if (str(raw.get("cp_impl", "")).lower() == "ring" and "context" in raw
            and not {"hsap_intra_size", "hsap_inter_size", "hierarchical_context_parallel_sizes"} & set(raw)):
        raw["hsap_inter_size"] = raw["context"]
    sizes = raw.pop("hierarchical_context_parallel_sizes", None)
    if sizes is None:
        return raw
    if not (isinstance(sizes, list) and len(sizes) == 2 and all(isinstance(s, int) for s in sizes)):
        raise ConfigError(f"parallel.hierarchical_context_parallel_sizes: expected [P_intra, P_inter], got {sizes!r}")
    for key, value in zip(("hsap_intra_size", "hsap_inter_size"), sizes):
        if key in raw and raw[key] != value:
            raise ConfigError(f"parallel.hierarchical_context_parallel_sizes: {sizes} contradicts "
                              f"parallel.{key}: {raw[key]}; give the sizes once")
        raw[key] = value
    return raw


def _unknown(keys: set[str], allowed: set[str], prefix: str) -> None:
    for key in sorted(keys - allowed):
        close = difflib.get_close_matches(key, sorted(allowed), n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {sorted(allowed)}"
        raise ConfigError(f"{prefix}{key}: unknown key{hint}")


def _build(cls: type, raw: Mapping[str, Any], section: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    _unknown(set(raw), names, f"{section}.")
    kwargs = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        kwargs[f.name] = _coerce(raw[f.name], hints[f.name], f"{section}.{f.name}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        missing = re.findall(r"'(\w+)'", str(exc))
        raise ConfigError(f"{section}.{missing[0] if missing else '?'}: required key missing") from exc


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _coerce(value, hint, key)
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(str(v) for v in items)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        by_lower = {m.value.lower(): m for m in hint}
        if isinstance(value, str) and value.lower() in by_lower:
            return by_lower[value.lower()]
        raise ConfigError(f"{key}: {value!r} is not one of {[m.value for m in hint]}")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if key.rsplit(".", 1)[-1] in _TOKEN_FIELDS:
            return parse_tokens(value, key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover - schema bug
