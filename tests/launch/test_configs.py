"""Every shipped config validates, and the validation refuses what Megatron or HSAP cannot run.

The per-config checks recompute each rule from the raw numbers here (a second implementation),
so a bug in the loader's own checks cannot hide a bad config. The slow test runs Megatron's real
``validate_args`` and the HSAP backend's ``validate_hsap_args`` on every config's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.launch import launch_env, load_config, to_megatron_args, torchrun_argv
from megatron_hsap.launch.config import CPImpl, Recompute, Sharding, config_from_dict
from megatron_hsap.launch.preflight import (
    Feature,
    check_untested,
    data_problems,
    placeholder_keys,
    untested_features,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
IDS = [str(p.relative_to(ROOT / "configs")) for p in CONFIGS]


def _flag(args: list[str], name: str, n: int = 1) -> list[str]:
    i = args.index(name)
    return args[i + 1:i + 1 + n]


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_every_config_validates(path: Path) -> None:
    cfg = load_config(path)
    m, p, c, t = cfg.model, cfg.parallel, cfg.cluster, cfg.training
    world = c.nnodes * c.gpus_per_node
    cp = p.hsap_intra_size * p.hsap_inter_size
    dp = world // (p.tensor * p.pipeline * cp)
    assert p.tensor * p.pipeline * dp * cp == world  # TP × PP × DP × CP = world size
    heads, kv = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    assert heads % p.tensor == 0 and kv % p.tensor == 0
    if p.cp_impl is CPImpl.HSAP:
        intra = p.hsap_intra_size
        assert (heads // p.tensor) % intra == 0  # the intra all-to-all splits q heads evenly
        kv_rank = kv // p.tensor
        assert kv_rank % intra == 0 or intra % kv_rank == 0  # kv heads split or replicated
        assert c.gpus_per_node % (p.tensor * intra) == 0  # CP ranks spaced by TP: one node
        assert m.attention_dropout == 0.0
    assert t.seq_length % (2 * cp) == 0  # Megatron's 2·CP rule; HSAP pads nothing else
    # The Megatron arguments carry the same sizes.
    args = to_megatron_args(cfg)
    assert _flag(args, "--context-parallel-size") == [str(cp)]
    assert _flag(args, "--tensor-model-parallel-size") == [str(p.tensor)]
    assert _flag(args, "--seq-length") == [str(t.seq_length)]
    if p.cp_impl is CPImpl.HSAP:
        assert _flag(args, "--hierarchical-context-parallel-sizes", 2) == [str(p.hsap_intra_size),
                                                                          str(p.hsap_inter_size)]
    assert ("--calculate-per-token-loss" in args) == t.per_token_loss  # either impl: the same training
    assert _flag(args, "--context-parallel-impl") == [p.cp_impl.value]


def test_figure5_gpt30b_configs() -> None:
    lengths = {}
    for path in sorted((ROOT / "configs").glob("gpt30b_64gpu_*.yaml")):
        cfg = load_config(path)
        lengths[cfg.training.seq_length] = cfg
        assert (cfg.world_size, cfg.cluster.nnodes, cfg.cluster.gpu_mem_gib) == (64, 8, 40)
        assert (cfg.parallel.tensor, cfg.parallel.hsap_intra_size, cfg.parallel.hsap_inter_size) == (1, 8, 8)
        assert cfg.training.recompute is Recompute.FULL
        m = cfg.model
        assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (64, 6144, 64)
    assert sorted(lengths) == [2**15, 2**16, 2**17, 2**18, 2**19]  # 32K … 512K


def test_table4_matrix_is_complete() -> None:
    seen = set()
    for path in sorted((ROOT / "configs").glob("llama2_7b_8gpu_*x*_*k.yaml")):
        cfg = load_config(path)
        p = cfg.parallel
        seen.add((p.hsap_intra_size, p.hsap_inter_size, cfg.training.seq_length))
        assert cfg.world_size == 8 and cfg.cluster.nnodes == 1 and p.tensor == 1
        # Llama-2-7b has 6,738,415,616 parameters (the published model card count).
        assert cfg.model.num_parameters() == 6_738_415_616
    want = {(i, 8 // i, s * 1024) for i in (1, 2, 4, 8) for s in (16, 32, 64)}
    assert seen == want


def _gpt(**over: object) -> dict:
    data = {
        "model": {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 16, "vocab_size": 1000},
        "parallel": {"tensor": 1, "hsap_intra_size": 2, "hsap_inter_size": 4, "inter_link": "ib"},
        "cluster": {"nnodes": 2, "gpus_per_node": 4},
        "training": {"seq_length": "16K"},
        "data": {"mock": True},
    }
    for dotted, value in over.items():
        section, key = dotted.split("__")
        data.setdefault(section, {})[key] = value
    return data


def test_small_config_roundtrip() -> None:
    cfg = config_from_dict(_gpt())
    assert cfg.training.seq_length == 16384 and cfg.data_size == 1 and cfg.context_size == 8
    assert cfg.parallel.sharding is Sharding.OPTIM
    ring = config_from_dict({**_gpt(), "parallel": {"cp_impl": "ring", "context": 8}})
    assert ring.context_size == 8 and "--cp-comm-type" in to_megatron_args(ring)
    # the loss normalisation: per-token under either impl by default (the same training), or Megatron's own
    assert "--calculate-per-token-loss" in to_megatron_args(cfg) and "--calculate-per-token-loss" in to_megatron_args(ring)
    for impl in ({}, {"cp_impl": "ring", "context": 8}):
        mean = config_from_dict({**_gpt(), "parallel": impl, "training": {"seq_length": "16K", "per_token_loss": False}})
        assert "--calculate-per-token-loss" not in to_megatron_args(mean)


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"parallel__hsap_intra_size": 8, "parallel__hsap_inter_size": 1}, "parallel.hsap_intra_size"),  # 8 ∤ 4 GPUs
        ({"parallel__tensor": 2, "parallel__hsap_intra_size": 4, "parallel__hsap_inter_size": 1},
         "parallel.hsap_intra_size"),  # TP 2 × intra 4 = 8 > 4 GPUs per node
        ({"model__num_attention_heads": 12, "model__hidden_size": 240, "parallel__hsap_intra_size": 8,
          "parallel__hsap_inter_size": 1, "cluster__gpus_per_node": 8, "cluster__nnodes": 1},
         "parallel.hsap_intra_size"),  # 8 ∤ 12 heads
        ({"model__num_query_groups": 3, "model__num_attention_heads": 12, "model__hidden_size": 240,
          "parallel__hsap_intra_size": 2, "parallel__hsap_inter_size": 4}, "parallel.hsap_intra_size"),  # 2, 3 coprime
        ({"parallel__tensor": 3}, "parallel"),  # 3·8 ∤ 8
        ({"parallel__data": 2}, "parallel.data"),
        ({"parallel__context": 16}, "parallel.context"),
        ({"training__seq_length": 16100}, "training.seq_length"),  # not a multiple of 2·CP = 16
        ({"model__attention_dropout": 1.0}, "model.attention_dropout"),  # [0, 1): HSAP runs dropout below 1
        ({"model__hiden_size": 4}, "model.hiden_size"),
        ({"parallel__sharding": "zero3"}, "parallel.sharding"),
        ({"training__seq_length": "lots"}, "training.seq_length"),
        ({"parallel__hierarchical_context_parallel_sizes": [4, 2]}, "parallel.hierarchical_context_parallel_sizes"),
        ({"cluster__hardware": "tpu"}, "cluster.hardware"),
    ],
)
def test_errors_name_the_key(over: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_gpt(**over))
    assert str(info.value).startswith(key), str(info.value)


def test_unknown_key_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match="did you mean model.hidden_size"):
        config_from_dict(_gpt(model__hiden_size=4))


def test_megatron_spelling_of_the_sizes_is_accepted() -> None:
    data = _gpt()
    del data["parallel"]["hsap_intra_size"], data["parallel"]["hsap_inter_size"]
    data["parallel"]["hierarchical_context_parallel_sizes"] = [2, 4]
    cfg = config_from_dict(data)
    assert (cfg.parallel.hsap_intra_size, cfg.parallel.hsap_inter_size) == (2, 4)
    ok = config_from_dict({**_gpt(), "megatron_args": ["--hierarchical-context-parallel-sizes", "2", "4"]})
    assert ok.megatron_args[-2:] == ("2", "4")
    with pytest.raises(ConfigError, match="megatron_args"):
        config_from_dict({**_gpt(), "megatron_args": ["--hierarchical-context-parallel-sizes", "4", "2"]})
    with pytest.raises(ConfigError, match="megatron_args"):
        config_from_dict({**_gpt(), "megatron_args": ["--seq-length", "8"]})
    with pytest.raises(ConfigError, match=r"megatron_args: \['--data-path'\] are set from the config"):
        config_from_dict({**_gpt(), "megatron_args": ["--data-path", "/d/x"]})
    # argparse reads "--flag=V" and keeps a repeated flag's last value: both spellings, every occurrence
    with pytest.raises(ConfigError, match=r"megatron_args: \['--seq-length'\] are set from the config"):
        config_from_dict({**_gpt(), "megatron_args": ["--seq-length=8"]})
    with pytest.raises(ConfigError, match="contradicts"):  # the second occurrence is the one Megatron keeps
        config_from_dict({**_gpt(), "megatron_args": ["--hierarchical-context-parallel-sizes", "2", "4",
                                                      "--hierarchical-context-parallel-sizes", "4", "2"]})
    with pytest.raises(ConfigError, match="contradicts"):  # nargs="+": a third size is read, not dropped
        config_from_dict({**_gpt(), "megatron_args": ["--hierarchical-context-parallel-sizes", "2", "4", "1"]})
    with pytest.raises(ConfigError, match="contradicts"):
        config_from_dict({**_gpt(), "megatron_args": ["--hierarchical-context-parallel-sizes=8"]})
    ok = config_from_dict({**_gpt(), "megatron_args": ["--hierarchical-context-parallel-sizes", "2", "4", "--bf16"]})
    assert ok.megatron_args[-1] == "--bf16"
    # Megatron's validation would refuse it on every rank once the job runs (arguments.check_before_megatron)
    with pytest.raises(ConfigError, match="megatron_args: --cp-comm-type selects Transformer Engine's"):
        config_from_dict({**_gpt(), "megatron_args": ["--cp-comm-type=a2a"]})
    ring = config_from_dict({**_gpt(), "parallel": {**_gpt()["parallel"], "cp_impl": "ring"},
                             "megatron_args": ["--cp-comm-type", "a2a"]})
    assert ring.megatron_args == ("--cp-comm-type", "a2a")  # TE's own choice for the ring baseline
    with pytest.raises(ConfigError, match=r"megatron_args: \['--no-hsap-plan-process'\] configure HSAP, but parallel.cp_impl is ring"):
        config_from_dict({**_gpt(), "parallel": {**_gpt()["parallel"], "cp_impl": "ring"},
                          "megatron_args": ["--no-hsap-plan-process"]})


def test_extends_merges_and_detects_cycles(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    child = tmp_path / "child.yaml"
    base.write_text("model: {num_layers: 2, hidden_size: 256, num_attention_heads: 16, vocab_size: 1000}\n"
                    "parallel: {hsap_intra_size: 2, hsap_inter_size: 4}\n"
                    "cluster: {nnodes: 2, gpus_per_node: 4}\ntraining: {seq_length: 8K}\ndata: {mock: true}\n")
    child.write_text("extends: base.yaml\ntraining: {seq_length: 32K}\n")
    cfg = load_config(child)
    assert cfg.name == "child" and cfg.training.seq_length == 32768 and cfg.model.num_layers == 2
    loop = tmp_path / "loop.yaml"
    loop.write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(loop)


def test_torchrun_line_and_environment() -> None:
    cfg = load_config(ROOT / "configs/gpt30b_64gpu_128k.yaml")
    argv = torchrun_argv(cfg, node_rank=3, master_addr="node01", master_port=29500, torchrun=["torchrun"])
    assert argv[:7] == ["torchrun", "--nnodes=8", "--nproc-per-node=8", "--node-rank=3",
                        "--master-addr=node01", "--master-port=29500", "scripts/pretrain_gpt_hsap.py"]
    assert argv[7:] == to_megatron_args(cfg)
    with pytest.raises(ConfigError, match="cluster.nnodes"):
        torchrun_argv(cfg, node_rank=0, master_addr="a", master_port=1, nnodes=4)
    # Default: the torchrun of this interpreter's environment, never a bare name.
    default = torchrun_argv(cfg, node_rank=3, master_addr="node01", master_port=29500)
    beside = Path(os.path.abspath(sys.executable)).parent / "torchrun"
    want = [str(beside)] if beside.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    assert default[:len(want)] == want and default[len(want):] == argv[1:]
    # Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1, plain TP/CP requires it.
    assert launch_env(cfg, {}) == {}
    with pytest.raises(ConfigError, match="parallel.sharding"):
        launch_env(cfg, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    llama = load_config(ROOT / "configs/llama2_7b_8gpu_2x4_32k.yaml")
    assert launch_env(llama, {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.mark.slow
def test_megatron_accepts_every_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's own ``validate_args`` (megatron-core 0.19.2) and the backend's
    ``validate_hsap_args`` accept every config's arguments: flag names, values and combinations
    (e.g. Megatron-FSDP needs ``--ckpt-format fsdp_dtensor``) are Megatron's, not ours."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_hsap.megatron.arguments import add_hsap_args, validate_hsap_args

    # validate_args asks the GPU for its architecture; an A100 (sm_80) is the paper's.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 8)
    parser = add_hsap_args(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    ring = config_from_dict({**_gpt(), "parallel": {"tensor": 2, "hsap_intra_size": 1, "hsap_inter_size": 4,
                                                    "cp_impl": "ring", "sequence_parallel": True}})
    for cfg in [load_config(p) for p in CONFIGS] + [ring, config_from_dict(_sft())]:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        for key, value in launch_env(cfg, os.environ).items():
            monkeypatch.setenv(key, value)
        args = parser.parse_args(to_megatron_args(cfg))
        args.rank, args.world_size = 0, cfg.world_size
        arguments.validate_args(args, {})
        assert args.context_parallel_size == cfg.context_size
        hsap = validate_hsap_args(args)
        if cfg.parallel.cp_impl is CPImpl.HSAP:
            assert (hsap.intra_size, hsap.inter_size) == (cfg.parallel.hsap_intra_size, cfg.parallel.hsap_inter_size)
        else:
            assert hsap is None and args.cp_comm_type == ["p2p"]


# --------------------------------------------------------------------------- untested features, data


def _expected_untested(cfg) -> set[str]:
    """The untested features, recomputed from the raw settings (not via preflight's table)."""
    p, args = cfg.parallel, list(cfg.megatron_args)
    out = set()
    fsdp = p.sharding.value in ("optim_grads", "optim_grads_params") or "--use-megatron-fsdp" in args
    if fsdp and (cfg.training.save or cfg.training.load or any(a in ("--save", "--load") for a in args)):
        out.add("fsdp_checkpoint")
    if p.cp_impl is CPImpl.RING and p.hsap_intra_size * p.hsap_inter_size > 1:
        out.add("ring_cp")
    if any(a.startswith(("--num-experts", "--cuda-graph", "--enable-cuda-graph", "--fp8")) for a in args):
        out.add("other")  # none of the shipped configs pass these through
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_shipped_configs_list_exactly_their_untested_features(path: Path) -> None:
    cfg = load_config(path)
    assert set(cfg.untested) == _expected_untested(cfg)
    assert {f.value for f in check_untested(cfg)} == set(cfg.untested)
    # The Figure-5 configs need Megatron-FSDP (29.3B parameters at TP 1 on 40 GB), nothing else
    # does; its training is tested, and they save no checkpoint (which would be fsdp_checkpoint).
    assert (cfg.parallel.sharding is Sharding.OPTIM_GRADS_PARAMS) == path.name.startswith("gpt30b")
    assert "fsdp_checkpoint" not in cfg.untested and cfg.training.save is None


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_mock_data_only_in_smoke_configs(path: Path) -> None:
    cfg = load_config(path)
    smoke = path.parent.name == "smoke"
    assert cfg.data.mock is smoke
    args = to_megatron_args(cfg)
    assert ("--mock-data" in args) is smoke and ("--data-path" in args) is not smoke
    if not smoke:  # the examples users copy: a real-data block whose paths are still to fill in
        assert cfg.data.data_path and all(p.startswith("<fill in") for p in cfg.data.data_path)
        assert placeholder_keys(cfg)[0] == "data.data_path"
        assert data_problems(cfg, check_files=False)
    if path.parent.name == "sft":  # Megatron's SFTDataset: its batches carry cu_seqlens and positions
        assert "--sft" in args and "--no-create-attention-mask-in-dataloader" in args
        assert "--reset-position-ids" not in args and "--dataloader-inter-document-masking" not in args
        return
    for flag in ("--dataloader-inter-document-masking", "--reset-position-ids", "--eod-mask-loss",
                 "--no-create-attention-mask-in-dataloader"):
        assert flag in args  # packed documents: boundaries, positions, no dense mask


def test_one_mock_data_smoke_config_per_model_family() -> None:
    smoke = [load_config(p) for p in (ROOT / "configs" / "smoke").glob("*.yaml")]
    bases = {load_config(p).model for p in (ROOT / "configs" / "base").glob("*.yaml")}
    assert {c.model for c in smoke} == bases  # one mock-data smoke run per model family
    for cfg in smoke:
        real = load_config(ROOT / "configs" / f"{cfg.name.removesuffix('_mock')}.yaml")
        assert (cfg.parallel, cfg.cluster, cfg.training.seq_length) == (
            real.parallel, real.cluster, real.training.seq_length)


def test_untested_list_must_match_use() -> None:
    fsdp = _gpt(parallel__sharding="optim_grads_params")
    assert untested_features(config_from_dict(fsdp)) == []  # Megatron-FSDP training: tests/megatron
    saving = _gpt(parallel__sharding="optim_grads_params", training__save="/ckpt")
    with pytest.raises(ConfigError, match=r"untested: .*fsdp_checkpoint.*acknowledge"):
        check_untested(config_from_dict(saving))
    assert check_untested(config_from_dict({**saving, "untested": ["fsdp_checkpoint"]})) == [Feature.FSDP_CHECKPOINT]
    loading = {**_gpt(parallel__sharding="optim_grads"), "megatron_args": ["--load", "/ckpt"]}
    assert untested_features(config_from_dict(loading)) == [Feature.FSDP_CHECKPOINT]
    assert untested_features(config_from_dict(_gpt(training__save="/ckpt"))) == []  # torch_dist: tested
    with pytest.raises(ConfigError, match="'megatron_fsdp' is tested now .*fsdp_checkpoint.*remove it"):
        config_from_dict({**_gpt(), "untested": ["megatron_fsdp"]})
    with pytest.raises(ConfigError, match=r"untested: \['cuda_graphs'\] listed but not used"):
        check_untested(config_from_dict({**_gpt(), "untested": ["cuda_graphs"]}))
    with pytest.raises(ConfigError, match="'sequence_parallel' is tested now .*remove it"):
        config_from_dict({**_gpt(), "untested": ["sequence_parallel"]})
    with pytest.raises(ConfigError, match="'sft' is tested now .*test_sft_pretrain_cpu.*remove it"):
        config_from_dict({**_gpt(), "untested": ["sft"]})
    sp = config_from_dict(_gpt(parallel__tensor=2, parallel__hsap_intra_size=1, parallel__sequence_parallel=True))
    assert untested_features(sp) == []  # run by tests/megatron/test_pretrain_cpu.py
    # ZeRO-3 with TP and SP is not claimed (a native heap crash once in six CPU runs); ZeRO-3 alone or with TP is run
    zero3 = dict(parallel__sharding="optim_grads_params", parallel__tensor=2, parallel__hsap_intra_size=1)
    assert untested_features(config_from_dict(_gpt(**zero3, parallel__sequence_parallel=True))) == [Feature.FSDP_TP_SP]
    assert untested_features(config_from_dict({**_gpt(**zero3), "megatron_args": ["--sequence-parallel"]})) == [Feature.FSDP_TP_SP]
    assert untested_features(config_from_dict(_gpt(**zero3))) == []
    # by the flags: Megatron's default sharding strategy is optim_grads_params
    flags = dict(parallel__tensor=2, parallel__hsap_intra_size=1, parallel__sequence_parallel=True)
    assert untested_features(config_from_dict({**_gpt(**flags), "megatron_args": ["--use-megatron-fsdp"]})) == [Feature.FSDP_TP_SP]
    zero2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
    assert untested_features(config_from_dict({**_gpt(**flags), "megatron_args": zero2})) == []
    assert untested_features(config_from_dict({**_gpt(), "megatron_args": ["--use-torch-fsdp2"]})) == [Feature.TORCH_FSDP2]
    assert untested_features(config_from_dict(_sft())) == []  # tests/megatron/test_sft_pretrain_cpu.py
    with pytest.raises(ConfigError, match="did you mean fsdp_checkpoint"):
        config_from_dict({**_gpt(), "untested": ["fsdp_checkpont"]})
    passthrough = {**_gpt(), "megatron_args": ["--num-experts", "8", "--ckpt-format", "torch"]}
    assert untested_features(config_from_dict(passthrough)) == [Feature.CKPT_FORMAT]  # MoE runs in test_pretrain_cpu
    ring = config_from_dict({**_gpt(), "parallel": {"cp_impl": "ring", "context": 8}})
    assert untested_features(ring) == [Feature.RING_CP]


@pytest.mark.parametrize(("data", "key"), [
    ({"mock": False}, "data.data_path"),
    ({"mock": True, "data_path": ["/d/x"]}, "data.mock"),
    ({"data_path": ["/d/x"], "tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/v"}, "data.merge_file"),
    ({"data_path": ["/d/x"], "tokenizer_type": "HuggingFaceTokenizer"}, "data.tokenizer_model"),
    ({"data_path": ["/d/x"], "tokenizer_type": "GPT2Tokenizer"}, "data.tokenizer_type"),
])
def test_data_block_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({**_gpt(), "data": data})
    assert str(info.value).startswith(key), str(info.value)


def _sft(**data: object) -> dict:
    """A config training on Megatron's SFT data (tests/megatron/test_sft_pretrain_cpu.py runs it on CPU)."""
    return {**_gpt(), "megatron_args": ["--sft"],
            "data": {"data_path": ["/d/conversations.jsonl"], "tokenizer_type": "SFTTokenizer", "tokenizer_model": "/d/tok",
                     "reset_position_ids": False, **data}}


def test_sft_configs_follow_what_sftdataset_asserts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--sft, but data.reset_position_ids is true: .* set data.reset_position_ids: false"):
        config_from_dict(_sft(reset_position_ids=True))
    cfg = config_from_dict(_sft(data_path=[str(tmp_path / "chat.jsonl")], tokenizer_model=str(tmp_path)))
    args = to_megatron_args(cfg)
    assert "--reset-position-ids" not in args and "--no-create-attention-mask-in-dataloader" in args
    assert _flag(args, "--tokenizer-type") == ["SFTTokenizer"]
    # SFTDataset reads each path as a jsonl file, not an indexed-dataset prefix
    assert data_problems(cfg, check_files=True) == [f"data.data_path: {tmp_path / 'chat.jsonl'} not found on this host; "
                                                    "with --sft give the jsonl file of conversations (Megatron's "
                                                    'SFTDataset: one {"messages": [...]} per line)']
    (tmp_path / "chat.jsonl").write_text('{"messages": []}\n')
    assert data_problems(cfg, check_files=True) == []


def test_data_files_are_checked_at_launch(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus_text_document"
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    data = {"data_path": ["0.7", str(prefix), "0.3", str(prefix)], "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": str(vocab), "merge_file": str(merges)}
    cfg = config_from_dict({**_gpt(), "data": data})
    assert data_problems(cfg, check_files=False) == []  # a dry run on a laptop: nothing to check
    problems = data_problems(cfg, check_files=True)
    assert len(problems) == 4 and "corpus_text_document.bin/.idx not found" in problems[0]
    for path in (prefix.with_suffix(".bin"), vocab, merges):
        path.write_text("x")
    problems = data_problems(cfg, check_files=True)
    assert len(problems) == 2 and all("corpus_text_document.idx not found" in p for p in problems)
    prefix.with_suffix(".idx").write_text("x")
    assert data_problems(cfg, check_files=True) == []
    args = to_megatron_args(cfg)
    assert _flag(args, "--data-path", 4) == data["data_path"] and _flag(args, "--merge-file") == [str(merges)]


def test_arguments_after_the_separator_are_checked_like_megatron_args(capsys: pytest.CaptureFixture[str]) -> None:
    # they follow megatron_args on the entry point's command line: argparse keeps the last value, so an
    # owned flag there would silently win over the config, and an untested feature would skip the gate
    from megatron_hsap.launch.__main__ import main

    smoke = str(ROOT / "configs/smoke/gpt30b_64gpu_128k_mock.yaml")
    assert main(["resolve", smoke, "--format", "json", "--", "--bf16", "--exit-interval", "5"]) == 0
    assert json.loads(capsys.readouterr().out)[-3:] == ["--bf16", "--exit-interval", "5"]
    for extra, said in ((["--seq-length=8"], r"megatron_args: ['--seq-length'] are set from the config"),
                        (["--cp-comm-type", "a2a"], "--cp-comm-type selects Transformer Engine's"),
                        (["--hierarchical-context-parallel-sizes", "4", "16"], "contradicts parallel.hsap_intra_size"),
                        (["--fp8-format", "hybrid"], "untested")):
        assert main(["resolve", smoke, "--format", "json", "--", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and said in err, err


def test_a_hybrid_layer_pattern_runs_the_hybrid_entry_script() -> None:
    """Megatron-LM builds hybrid models with ``pretrain_hybrid.py``: the default entry follows the
    pattern, and an entry script of this project given the other script's model is refused when the
    config is read (the script itself would refuse it at start-up, after the job queued)."""
    hybrid = ["--hybrid-layer-pattern", "M*M-"]
    assert config_from_dict(_gpt()).entry == "scripts/pretrain_gpt_hsap.py"
    cfg = config_from_dict({**_gpt(), "megatron_args": hybrid})
    assert cfg.entry == "scripts/pretrain_hybrid_hsap.py" and to_megatron_args(cfg)[-2:] == hybrid
    assert config_from_dict({**_gpt(), "megatron_args": hybrid, "entry": "/x/my_train.py"}).entry == "/x/my_train.py"
    with pytest.raises(ConfigError, match=r"entry /x/scripts/pretrain_gpt_hsap.py with these megatron_args: "
                                          r"--hybrid-layer-pattern: Megatron-LM trains hybrid models with pretrain_hybrid.py"):
        config_from_dict({**_gpt(), "megatron_args": hybrid, "entry": "/x/scripts/pretrain_gpt_hsap.py"})
    with pytest.raises(ConfigError, match=r"entry scripts/pretrain_hybrid_hsap.py with these megatron_args: "
                                          r"pretrain_hybrid.py builds a HybridModel"):
        config_from_dict({**_gpt(), "entry": "scripts/pretrain_hybrid_hsap.py"})


def test_resolve_prints_nothing_before_a_node_rank_error(tmp_path: Path, capsys, monkeypatch) -> None:
    # `eval "$(launch resolve ...)"` must not get the export lines of a run that errs
    from megatron_hsap.launch.__main__ import main

    smoke = str(ROOT / "configs/smoke/llama2_7b_8gpu_2x4_32k_mock.yaml")
    assert main(["resolve", smoke, "--nodes", "node1", "--node-rank", "0"]) == 0
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in capsys.readouterr().out
    assert main(["resolve", smoke, "--nodes", "node1", "--node-rank", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error: node rank 3 is outside [0, 1)" in err, (out, err)
    monkeypatch.setenv("SLURM_NODEID", "one")
    fake = tmp_path / "torchrun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("launched"))
    assert main(["exec", smoke, "--nodes", "node1", "--torchrun", str(fake)]) == 2
    assert "error: $SLURM_NODEID='one' is not a node rank (an integer)" in capsys.readouterr().err


def test_launcher_refuses_placeholders_and_prints_untested(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.launch.__main__ import main

    gpt = str(ROOT / "configs/gpt30b_64gpu_128k.yaml")
    fake = tmp_path / "torchrun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    common = ["--nodes", "node[01-08]", "--all-nodes", "--torchrun", str(fake)]
    assert main(["resolve", gpt, *common]) == 0  # a dry run warns and prints the lines
    out, err = capsys.readouterr()
    assert "warning: data.data_path, data.vocab_file, data.merge_file: still the example's" in err
    assert "# untested by the (CPU) test suite: nothing;" in out  # Megatron-FSDP training is tested
    assert f"# torchrun: {fake} (explicit" in out
    assert sum(line.startswith(f"{fake} --nnodes=8") for line in out.splitlines()) == 8
    assert main(["resolve", gpt, *common, "--for-launch"]) == 2  # what a launch runs first
    out, err = capsys.readouterr()
    assert out == "" and "error: " in err and "cannot be launched" in err and "configs/smoke/" in err
    assert main(["exec", gpt, "--nodes", "node[01-08]", "--node-rank", "0", "--torchrun", str(fake)]) == 2
    assert "placeholder" in capsys.readouterr().err
    assert main(["validate", gpt, str(ROOT / "configs/smoke/gpt30b_64gpu_128k_mock.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.count("untested by the (CPU) test suite: nothing;") == 2
    assert out.count("to fill in before a launch (placeholders): data.data_path, data.vocab_file, "
                     "data.merge_file") == 1  # the smoke config has none
    unlisted = tmp_path / "unlisted.yaml"
    unlisted.write_text(f"extends: {ROOT / 'configs/smoke/gpt30b_64gpu_128k_mock.yaml'}\n"
                        f"training:\n  save: {tmp_path / 'ckpt'}\n")
    assert main(["validate", str(unlisted)]) == 2
    assert "untested: the config uses what the test suite does not run (fsdp_checkpoint" in capsys.readouterr().err
