"""CUDA graphs under HSAP (``megatron/cuda_graphs.py``, ``runtime/capture.py``): a graph replays the
batch it captured, HSAP's attention and scan layers run a plan compiled per batch, so every capture
of one is refused — by Megatron's flags (parsed by Megatron's own parser, before and after its own
``validate_args``; a launch config's ``megatron_args``) and at the layer itself; the MLP / MoE
modules stay allowed. Capturing needs a GPU; the capture state is stubbed here (``scripts/gpu_check.sh``
captures a real one)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_hsap.errors import ConfigError
from megatron_hsap.launch.config import config_from_dict
from megatron_hsap.launch.preflight import untested_features
from megatron_hsap.megatron.arguments import add_hsap_args, validate_hsap_args
from megatron_hsap.megatron.cuda_graphs import GRAPHABLE_MODULES, argv_cuda_graphs, cuda_graph_problem, namespace_cuda_graphs
from megatron_hsap.runtime import capture
from tests.launch.test_configs import _gpt as launch_config

megatron_arguments = pytest.importorskip("megatron.training.arguments")

GOOD = ["--context-parallel-impl", "hsap", "--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2",
        "--num-attention-heads", "8", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1", "--lr", "1e-4", "--train-iters", "1",
        "--transformer-impl", "local", "--calculate-per-token-loss", "--no-check-for-nan-in-loss-and-grad"]

# (Megatron flags, the words the refusal must name)
REFUSED = [
    (["--cuda-graph-impl", "local"], "without --cuda-graph-modules captures whole transformer layers"),
    (["--cuda-graph-impl", "transformer_engine"], "without --cuda-graph-modules"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "full"], "without --cuda-graph-modules"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"], "--cuda-graph-modules attn would capture HSAP layers"),
    (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "mlp", "attn"], "--cuda-graph-modules attn "),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "mamba"], "mamba: Mamba layers"),
    (["--cuda-graph-impl", "full_iteration"], "full_iteration captures the whole training step"),
    (["--cuda-graph-modules", "full_iteration"], "full_iteration captures the whole training step"),  # deprecated spelling
    (["--enable-cuda-graph"], "--cuda-graph-impl local without --cuda-graph-modules"),  # deprecated: local
    (["--external-cuda-graph", "--cuda-graph-scope", "attn"], "--cuda-graph-modules attn "),  # deprecated: TE + scope
]
ALLOWED = [
    [],
    ["--cuda-graph-impl", "local", "--cuda-graph-modules", "mlp"],
    ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe_router", "moe_preprocess"],
    ["--cuda-graph-impl", "local", "--cuda-graph-modules", *GRAPHABLE_MODULES],
    ["--cuda-graph-modules", "attn"],  # no implementation: Megatron captures nothing
    ["--enable-cuda-graph", "--cuda-graph-scope", "mlp"],
    ["--optimizer-cuda-graph"],  # the optimizer step holds no attention
]
IDS_R = [" ".join(c) for c, _ in REFUSED]
IDS_A = [" ".join(c) or "none" for c in ALLOWED]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = add_hsap_args(megatron_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return parser.parse_args(argv)


def _megatron_validated(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The namespace after Megatron's own ``validate_args`` (deprecated flags mapped, modules as enums)."""
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 8)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = _parse(argv)
    args.rank, args.world_size = 0, 4
    megatron_arguments.validate_args(args, {})
    return args


@pytest.mark.parametrize(("change", "match"), REFUSED, ids=IDS_R)
def test_captures_of_hsap_layers_are_refused_before_and_after_megatron_validates(
        change: list[str], match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # before Megatron's validate_args (run_pretrain's check_before_megatron sees this namespace)
    with pytest.raises(ConfigError, match=match):
        validate_hsap_args(_parse(GOOD + change))
    # after it: the same verdict on Megatron's normalised settings
    args = _megatron_validated(GOOD + change, monkeypatch)
    with pytest.raises(ConfigError, match=match):
        validate_hsap_args(args)
    # a launch config's megatron_args read the same tokens, in either spelling of the implementation
    assert cuda_graph_problem(*argv_cuda_graphs(change)) is not None
    if change[0] == "--cuda-graph-impl":
        assert cuda_graph_problem(*argv_cuda_graphs([f"--cuda-graph-impl={change[1]}", *change[2:]])) is not None


@pytest.mark.parametrize("change", ALLOWED, ids=IDS_A)
def test_captures_without_hsap_layers_are_accepted(change: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert validate_hsap_args(_parse(GOOD + change)) is not None
    args = _megatron_validated(GOOD + change, monkeypatch)
    assert validate_hsap_args(args) is not None
    assert cuda_graph_problem(*namespace_cuda_graphs(args)) is None
    assert cuda_graph_problem(*argv_cuda_graphs(change)) is None


def test_megatron_normalises_what_the_rule_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # the rule reads both forms: raw (deprecated flags, strings) and Megatron's validated one
    raw = _parse(GOOD + ["--external-cuda-graph", "--cuda-graph-scope", "mlp"])
    assert namespace_cuda_graphs(raw) == ("transformer_engine", ["mlp"])
    done = _megatron_validated(GOOD + ["--external-cuda-graph", "--cuda-graph-scope", "mlp"], monkeypatch)
    assert done.cuda_graph_impl == "transformer_engine" and not hasattr(done, "external_cuda_graph")
    assert namespace_cuda_graphs(done) == ("transformer_engine", ["mlp"])
    done = _megatron_validated(GOOD + ["--cuda-graph-modules", "full_iteration"], monkeypatch)
    assert (done.cuda_graph_impl, done.cuda_graph_modules) == ("full_iteration", [])


def test_ring_runs_keep_megatron_s_graphs() -> None:
    ring = [a for a in GOOD if a not in ("hsap",)]
    ring[ring.index("--context-parallel-impl") + 1:ring.index("--context-parallel-impl") + 1] = ["ring"]
    ring = [a for i, a in enumerate(ring) if a != "--hierarchical-context-parallel-sizes" and
            ring[i - 1] != "--hierarchical-context-parallel-sizes" and ring[i - 2] != "--hierarchical-context-parallel-sizes"]
    assert validate_hsap_args(_parse(ring + ["--cuda-graph-impl", "local"])) is None


def _gpt(megatron_args: list[str], cp_impl: str = "hsap") -> dict:
    return {**launch_config(parallel__cp_impl=cp_impl), "megatron_args": megatron_args}


def test_launch_configs_refuse_them_when_read() -> None:
    with pytest.raises(ConfigError, match="megatron_args: --cuda-graph-impl local without --cuda-graph-modules"):
        config_from_dict(_gpt(["--cuda-graph-impl=local"]))
    with pytest.raises(ConfigError, match="megatron_args: --cuda-graph-modules attn would capture"):
        config_from_dict(_gpt(["--cuda-graph-impl", "local", "--cuda-graph-modules", "mlp", "attn", "--bf16"]))
    ok = config_from_dict({**_gpt(["--cuda-graph-impl", "local", "--cuda-graph-modules", "mlp"]), "untested": ["cuda_graphs"]})
    assert [f.value for f in untested_features(ok)] == ["cuda_graphs"]  # allowed, and still not run by the suite
    ring = config_from_dict({**_gpt(["--cuda-graph-impl", "local"], "ring"), "untested": ["ring_cp", "cuda_graphs"]})
    assert ring.megatron_args == ("--cuda-graph-impl", "local")


def _capturing(monkeypatch: pytest.MonkeyPatch, on: bool = True) -> None:
    monkeypatch.setattr(capture.torch.cuda, "is_current_stream_capturing", lambda: on)


def test_the_layers_refuse_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    _capturing(monkeypatch)
    with pytest.raises(ConfigError, match="hsap_attn_func is being captured into a CUDA graph"):
        capture.refuse_graph_capture(cuda, "hsap_attn_func")
    capture.refuse_graph_capture(torch.device("cpu"), "hsap_attn_func")  # (host tensors: no graph)
    _capturing(monkeypatch, False)
    capture.refuse_graph_capture(cuda, "hsap_attn_func")


def test_hsap_attn_func_and_the_scan_layers_check_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both entry points run the check before anything that could communicate: with the stub, a
    CUDA device refuses although nothing else about the call is valid."""
    from megatron_hsap.megatron import mamba
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap

    seen: list[tuple[torch.device, str]] = []

    def refuse(device: torch.device, what: str) -> None:
        seen.append((device, what))
        raise ConfigError(f"{what} refused")

    monkeypatch.setattr(hsap, "refuse_graph_capture", refuse)
    monkeypatch.setattr(mamba, "refuse_graph_capture", refuse)
    plan = compile_plan([0, 64], 2, 1, num_heads=2, num_kv_heads=2, head_dim=8)  # no group initialised
    q = torch.zeros(32, 2, 8)
    with pytest.raises(ConfigError, match="hsap_attn_func refused"):
        hsap.hsap_attn_func(q, q, q, plan)
    with pytest.raises(ConfigError, match="HSAP's Mamba layer refused"):
        mamba.checked_stream_order("Mamba", None, None, torch.device("cpu"), inference=False)
    assert seen == [(q.device, "hsap_attn_func"), (torch.device("cpu"), "HSAP's Mamba layer")]

