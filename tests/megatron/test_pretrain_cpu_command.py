"""The ``pretrain-cpu`` command's pure parts, no rank spawned: the model families' flags, the loss
comparison, Megatron's log lines, refusals before spawning and which reference ``--compare`` runs
(``reference_of``). The runs they refer to are in ``test_pretrain_cpu.py``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.cpu.command import CPURun, compare_losses, megatron_flags, parse_log, parse_mtp_losses, reference_of


def test_model_families_build_the_shipped_configs_layers() -> None:
    llama, gpt = megatron_flags(CPURun()), megatron_flags(CPURun(model="gpt"))
    for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--group-query-attention"):
        assert flag in llama and flag not in gpt
    assert gpt[gpt.index("--normalization") + 1] == "LayerNorm" and llama[llama.index("--normalization") + 1] == "RMSNorm"
    assert "--untie-embeddings-and-output-weights" not in megatron_flags(CPURun(tie_embeddings=True))
    with pytest.raises(ConfigError, match="--model 'bert': one of llama, gpt"):
        CPURun(model="bert").check()
    CPURun(model="gpt", intra_size=4, inter_size=1).check()  # 4 kv heads over P_intra 4


def test_compare_losses_needs_the_same_logged_iterations() -> None:
    assert compare_losses({1: 2.0, 2: 1.0}, {1: 2.0, 2: 1.1}) == (pytest.approx(0.1 / 1.1), "")
    worst, why = compare_losses({5: 1.0}, {4: 1.0, 5: 1.0})
    assert math.isnan(worst) and "different iterations (this run [5], the reference [4, 5])" in why
    worst, why = compare_losses({}, {})  # fp16 from a loss scale of 2^32: every update skipped
    assert math.isnan(worst) and "--initial-loss-scale" in why


def test_parse_log_reads_megatrons_lines() -> None:
    text = (
        " [2026-12-01 09:20:50] iteration        1/       3 | consumed samples: 2 | lm loss: 5.547852E+00 | loss scale: 1.0 |\n"
        " validation loss at iteration 3 | lm loss value: 4.826138E+00 | lm loss PPL: 1.2E+02 |\n"
        " validation loss at iteration 3 on validation set | lm loss value: 4.829963E+00 | lm loss PPL: 1.2E+02 |\n"
        " validation loss at iteration 3 on test set | lm loss value: 4.777941E+00 | lm loss PPL: 1.1E+02 |\n"
    )
    losses, validation, final = parse_log(text)
    assert losses == {1: 5.547852} and validation == {3: 4.826138}
    assert final == {"validation": 4.829963, "test": 4.777941}
    assert parse_mtp_losses(text) == {}


def test_parse_mtp_losses_reads_each_depth_by_iteration() -> None:
    text = (
        " iteration        1/       6 | lm loss: 5.573047E+00 | mtp_1 loss: 5.554393E+00 | mtp_2 loss: 5.60E+00 |\n"
        " iteration        2/       6 | lm loss: 5.377874E+00 | mtp_1 loss: 5.413392E+00 | mtp_2 loss: 5.41E+00 |\n"
        " some other line | mtp_1 loss: 9.9 |\n"
    )
    assert parse_mtp_losses(text) == {1: {1: 5.554393, 2: 5.413392}, 2: {1: 5.6, 2: 5.41}}


def test_mtp_with_a_checkout_compares_with_hsap_at_cp1() -> None:
    """The checkout's forward step gives the local reference a mask and no packed sequence, so
    Megatron's MTP would shift across documents there: ``--compare`` runs HSAP at CP=1 instead. The
    CPU loop's own reference shifts inside documents (``cpu/loop.py``), so it stays local attention."""
    mtp = ("--mtp-num-layers", "1")
    ref, name = reference_of(CPURun(megatron_lm="/x", extra=mtp))
    assert (ref.intra_size, ref.inter_size, ref.reference) == (1, 1, False) and "--mtp-num-layers with --megatron-lm" in name
    ref, name = reference_of(CPURun(extra=mtp))
    assert ref.reference and name == "CP=1, local attention"


def test_mtp_compare_refuses_a_reference_that_splits_the_micro_batch() -> None:
    """Experts split over more ranks than the run's data-parallel ones make the reference run each
    micro-batch in pieces; Megatron weights MTP's loss per micro-batch, so that comparison would
    show the weighting (6.8e-5), not HSAP. With the split inside the DP ranks it is kept."""
    moe = ("--mtp-num-layers", "1", "--num-experts", "4", "--expert-model-parallel-size", "2")
    with pytest.raises(ConfigError, match=r"splits each micro-batch of 2 samples into micro-batches of 1 .* multiple "
                                          r"of the expert split \(2\)"):
        reference_of(CPURun(extra=moe))
    ref, _ = reference_of(CPURun(world_size=8, micro_batch_size=1, extra=moe))  # DP 2: the split keeps micro-batches of 1
    assert (ref.world_size, ref.micro_batch_size) == (2, 1)
    ref, _ = reference_of(CPURun(extra=moe[2:]))  # without MTP the split is fine
    assert ref.micro_batch_size == 1


@pytest.mark.parametrize(("change", "match"), [
    (dict(world_size=3), "not a multiple"),
    (dict(tp=2, reference=True), "drop --tp"),
    (dict(pp=4, world_size=4, reference=True), "stages between the first and the last read no data"),
    (dict(pp=2, vp=1, world_size=2, reference=True), "--pp 2 --vp"),
    (dict(steps=0), "--steps 0"),
    (dict(world_size=16, intra_size=4, inter_size=4), "at most 8"),
    (dict(vp=2), r"--vp 2 interleaves pipeline stages: it needs --pp 2 or more"),  # (Megatron ignored it at 2 layers)
    # data the CPU provider would not read (it trained its corpus whatever they said)
    (dict(extra=("--data-path", "/d/x_text_document", "--tokenizer-type=HuggingFaceTokenizer")),
     r"^--data-path, --tokenizer-type after --: pretrain-cpu trains on its own CPU corpus .* scripts/pretrain_gpt_hsap.py"),
    (dict(sft=True, extra=("--sft-tokenizer-prompt-format", "identity")), "--sft-tokenizer-prompt-format after --"),
])
def test_bad_sizes_are_refused_before_spawning(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CPURun(**change).check()


@pytest.mark.parametrize("extra", [("--window-size", "64,0"), ("--window-size=(32,0)",),
                                   ("--multi-latent-attention", "--kv-lora-rank", "16"),
                                   ("--hybrid-layer-pattern", "*-+-")])
def test_models_local_attention_cannot_compute_compare_with_hsap_at_cp1(extra: tuple[str, ...], capsys) -> None:  # noqa: ANN001
    """Megatron's local attention ignores the document mask under a window and builds no MLA: the
    CLI's --compare once printed a 2.7e-3 "difference" for a windowed 2x2 run that was the
    reference's mask. Such models are compared with the same loop at CP=1 under HSAP, and
    ``--reference`` alone is refused before any rank is spawned, naming the flag."""
    from megatron_hsap.megatron.cpu.command import main, no_local_reference, reference_of

    opts = CPURun(world_size=8, tp=2, intra_size=2, inter_size=2, extra=extra)
    ref, name = reference_of(opts)
    assert (ref.reference, ref.tp, ref.pp, ref.intra_size, ref.inter_size, ref.world_size) == (False, 1, 1, 1, 1, 1)
    assert ref.extra == extra and name.startswith("CP=1 under HSAP; " + extra[0].split("=")[0])
    assert "--spec" not in megatron_flags(ref)  # HSAP's own spec (validate_hsap_args sets it)
    assert len(no_local_reference(opts)) == 1
    with pytest.raises(ConfigError, match="--reference cannot run this model: " + extra[0].split("=")[0]):
        replace(ref, reference=True).check()
    assert main(["--reference", "--", *extra]) == 2
    assert "Use --compare" in capsys.readouterr().err


def test_attention_dropout_compares_with_hsap_at_cp1_keeping_the_tp() -> None:
    """Megatron's local attention draws its own dropout masks, HSAP's CPU kernel keys them on (seed,
    head, token, token): the reference is HSAP at CP=1, at the run's TP (each TP rank's CPU
    generator draws its seeds; a TP 1 reference measured 4.7e-4 off a TP 2 run, TP 2 at CP=1 1.9e-7).
    Dropout 0 keeps Megatron's local attention and TP 1."""
    opts = CPURun(world_size=8, tp=2, intra_size=2, inter_size=2, extra=("--sequence-parallel", "--attention-dropout", "0.1"))
    ref, name = reference_of(opts)
    assert (ref.reference, ref.tp, ref.intra_size, ref.inter_size, ref.world_size) == (False, 2, 1, 1, 2)
    assert name.startswith("CP=1 under HSAP; --attention-dropout 0.1")
    # HSAP's own flags tune the CP run; the CP=1 reference under HSAP would refuse some of them
    ref, _ = reference_of(replace(opts, extra=(*opts.extra, "--hsap-head-chunks", "2", "--hsap-flatten", "never")))
    assert ref.extra == opts.extra
    ref, name = reference_of(replace(opts, extra=("--attention-dropout", "0.0")))
    assert (ref.reference, ref.tp, name) == (True, 1, "CP=1, local attention")
    with pytest.raises(ConfigError, match="--attention-dropout 'lots'"):
        reference_of(replace(opts, extra=("--attention-dropout", "lots")))


def test_hybrid_reference_gets_megatrons_local_stack_spec() -> None:
    """megatron-core's default hybrid stack is Transformer Engine's; the CPU reference of a hybrid
    pattern without MLA layers is its local twin (``cpu/reference_spec.py``), unless a spec is given."""
    from megatron_hsap.megatron.cpu.command import reference_of

    ref, name = reference_of(CPURun(world_size=2, intra_size=1, inter_size=2, extra=("--hybrid-layer-pattern", "*--*-")))
    flags = megatron_flags(ref)
    assert name == "CP=1, local attention" and ref.world_size == 1
    spec = flags.index("--spec")
    assert flags[spec + 1:spec + 3] == ["megatron_hsap.megatron.cpu.reference_spec", "REFERENCE_HYBRID_STACK_SPEC"]
    given = ("--hybrid-layer-pattern", "*-", "--spec", "my.module", "SPEC")
    assert megatron_flags(CPURun(world_size=1, reference=True, extra=given)).count("--spec") == 1


def test_plain_models_compare_with_megatrons_local_attention() -> None:
    from megatron_hsap.megatron.cpu.command import reference_of

    opts = CPURun(world_size=8, tp=2, intra_size=2, inter_size=1, extra=("--sequence-parallel", "--qk-layernorm"))
    ref, name = reference_of(opts)
    assert name == "CP=1, local attention"
    assert (ref.reference, ref.tp, ref.pp, ref.world_size, ref.cp_size) == (True, 1, 1, 2, 1)  # DP 2 kept
    assert (ref.micro_batch_size, ref.global_batch_size, ref.extra) == (2, 4, opts.extra)
    # the document mask only for packed samples: unpacked, a sample is one document to HSAP too
    assert "--reset-attention-mask" in megatron_flags(ref)
    assert "--reset-attention-mask" not in megatron_flags(reference_of(replace(opts, packed=False))[0])
    # HSAP's own flags configure the HSAP run: the ring reference drops them (a ring run refuses them)
    hsap_flags = ("--hsap-flatten", "never", "--hsap-dump-plan", "2", "/tmp/d", "--no-hsap-plan-process")
    ref, _ = reference_of(replace(opts, extra=(*hsap_flags, *opts.extra)))
    assert ref.extra == opts.extra


@pytest.mark.parametrize(("sizes", "extra", "want"), [
    # EP 2 over CP 2x2 (DP 1): the reference needs 2 ranks for the experts, one sample each
    (dict(world_size=4), ("--num-experts", "4", "--expert-model-parallel-size", "2"), (2, 1, 2)),
    (dict(world_size=8, micro_batch_size=2), ("--expert-model-parallel-size=4",), (4, 1, 4)),  # DP 2, EP 4
    (dict(world_size=8, micro_batch_size=3), ("--expert-model-parallel-size", "2"), (2, 3, 6)),  # DP 2 = EP
])
def test_reference_splits_experts_as_the_run_does(sizes: dict, extra: tuple[str, ...], want: tuple[int, int, int]) -> None:
    """Megatron seeds each expert by its expert-parallel rank: an EP 1 reference of an EP 2 run
    differs from the first step (measured 7.4e-3), the EP 2 reference at DP 2 is equal (slow test
    ``test_experts_split_over_the_cp_ranks_equal_the_reference``). The reference keeps the split, on ranks sharing the same global batch."""
    from megatron_hsap.megatron.cpu.command import reference_of

    ref, _ = reference_of(CPURun(intra_size=2, inter_size=2, extra=extra, **sizes))
    assert (ref.world_size, ref.micro_batch_size, ref.global_batch_size) == want
    assert ref.extra == extra and ref.reference
    ref.check()


def test_compare_with_reference_is_refused_before_spawning(capsys, monkeypatch) -> None:  # noqa: ANN001
    # it compared the reference run with itself (0.00e+00) after running it twice
    from megatron_hsap.megatron.cpu import command

    monkeypatch.setattr(command, "run", lambda *a, **k: pytest.fail("spawned"))
    assert command.main(["--reference", "--compare"]) == 2
    assert "with --reference it would compare the reference with itself" in capsys.readouterr().err


def test_reference_that_cannot_split_the_batch_is_refused_before_spawning(capsys) -> None:  # noqa: ANN001
    from megatron_hsap.megatron.cpu.command import main, reference_of

    with pytest.raises(ConfigError, match="global batch of 1 samples does not split.*multiple of 2"):
        reference_of(CPURun(world_size=4, micro_batch_size=1, extra=("--expert-model-parallel-size", "2")))
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 'two': not an integer"):
        reference_of(CPURun(extra=("--expert-model-parallel-size", "two")))
    assert main(["--micro-batch-size", "1", "--compare", "--", "--expert-model-parallel-size", "2"]) == 2
    assert "does not split" in capsys.readouterr().err


def test_loop_tests_rerun_a_megatron_fsdp_run_once_after_a_native_crash(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # the harness of the slow loop tests: a signal death of a Megatron-FSDP run is rerun once (kept
    # logs, a warning); a second death, a plain failure, or a death without FSDP fail at once
    import tests.megatron.test_pretrain_cpu as loop
    from megatron_hsap.megatron.cpu.command import CPUResult

    codes: list[int] = []

    def fake(opts, *, record_dir=None):  # noqa: ANN001, ANN202
        code = codes.pop(0)
        return CPUResult(returncode=code, losses={1: 1.0}, validation={}, final_validation=None, final_test=None,
                         log_dir=opts.log_dir, output=f"exit {code}")

    monkeypatch.setattr(loop, "run", fake)
    monkeypatch.setattr(loop, "_RUNS", {})
    fsdp = dict(extra=("--use-megatron-fsdp",), steps=2)
    codes[:] = [-11, 0]
    with pytest.warns(UserWarning, match=r"a rank died by signal 11; running it again \(logs kept in .*run\d+\)"):
        assert loop._run(tmp_path, **fsdp).returncode == 0
    assert codes == []
    for first, extra in (([-11, -11], ("--use-megatron-fsdp",)), ([1], ("--use-megatron-fsdp",)), ([-11], ())):
        codes[:] = list(first)
        with pytest.raises(AssertionError, match=f"exit {first[-1]}"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop._run(tmp_path, extra=extra, steps=3 + len(first) + len(extra))
        assert codes == []
