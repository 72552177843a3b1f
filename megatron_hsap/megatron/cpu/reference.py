"""What ``megatron-hsap pretrain-cpu --compare`` compares a run with (``reference_of``), and how the
two runs' losses compare (``compare_losses``).

The reference is the same job at CP=1, TP=1 with megatron-core's local attention and the
dataloader's per-document causal mask; where that attention cannot compute the model
(``no_local_reference``) it is the same loop at CP=1 under HSAP.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_hsap.argtypes import flag_value
from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.arguments import drop_hsap_flags

if TYPE_CHECKING:
    from megatron_hsap.megatron.cpu.command import CPURun

__all__ = ["compare_losses", "hybrid_pattern", "no_local_reference", "reference_of"]

# Megatron flags whose model megatron-core's local DotProductAttention (``--reference``) cannot
# compute, and why (megatron-core 0.19.2). Without this, ``--compare --window-size 64,0`` printed a
# 2.7e-3 "difference" that was the reference's mask, not HSAP.
_NO_LOCAL_REFERENCE = {
    "--multi-latent-attention": "megatron-core builds no MLA without Transformer Engine (its local "
    "DotProductAttention takes no k_channels / v_channels)",
    "--window-size": "with a window, megatron-core's local DotProductAttention replaces the dataloader's "
    "per-document mask by a plain sliding-window mask (fusions/fused_softmax.py, forward_torch_softmax)",
    "--experimental-attention-variant": "its gated delta net layers restart their scan at each document only by "
    "the packed sequence, and the local reference feeds the model a mask, no packed sequence",
}


_SCANS = {"M": "Mamba", "G": "gated delta net"}  # hybrid layers that scan the packed stream (and draw parameters per TP rank)


def hybrid_pattern(extra: tuple[str, ...]) -> str | None:
    """The ``HybridModel`` layer pattern of Megatron flags ``extra`` (either spelling), None for GPT."""
    return flag_value(extra, "--hybrid-layer-pattern") or flag_value(extra, "--hybrid-override-pattern")


def no_local_reference(opts: CPURun) -> list[str]:
    """``"flag: why"`` for each setting of ``opts`` whose model megatron-core's local attention cannot
    be the reference of: Megatron flags (``_NO_LOCAL_REFERENCE``, a hybrid pattern with MLA layers
    ``+``) and pipeline stages that read no data (PP > 2, virtual pipelining); empty when it can."""
    extra = opts.extra
    # (--multi-latent-attention is a switch: present when any argument is it)
    why = [f"{flag}: {why}" for flag, why in _NO_LOCAL_REFERENCE.items() if flag in extra or flag_value(extra, flag)]
    if (dropout := _dropout(extra)) > 0:
        why.append(f"--attention-dropout {dropout:g}: megatron-core's local attention draws its own dropout masks; "
                   "HSAP's CPU kernel keys each on (seed, head, token, token), so its CP=1 run draws the same ones "
                   "(runtime/dropout.py)")
    pattern = hybrid_pattern(extra)
    if pattern and "+" in pattern and "--multi-latent-attention" not in extra:  # (else said once above)
        why.append(f"--hybrid-layer-pattern {pattern}: its MLA layers ('+'): {_NO_LOCAL_REFERENCE['--multi-latent-attention']}")
    if pattern and set(pattern) & set(_SCANS):
        kinds = " and ".join(f"{_SCANS[s]} ('{s}')" for s in sorted(set(pattern) & set(_SCANS)))
        why.append(f"--hybrid-layer-pattern {pattern}: its {kinds} layers restart their scan at each document only by "
                   "the packed sequence, and the local reference feeds the model a mask, no packed sequence")
    if opts.megatron_lm and flag_value(extra, "--mtp-num-layers"):
        why.append("--mtp-num-layers with --megatron-lm: the checkout's forward step gives the local attention a "
                   "mask and no packed sequence, so Megatron's MTP would shift tokens across documents (the CPU "
                   "loop's reference shifts inside them: cpu/loop.py)")
    if (opts.pp > 2 or opts.vp is not None) and not opts.sft:  # (with --sft every stage reads the batch)
        why.append(f"--pp {opts.pp}{' --vp' if opts.vp is not None else ''}: its attention needs the dataloader's "
                   "mask on every pipeline stage, and stages between the first and the last read no data "
                   "(it runs --pp 2 without --vp)")
    return why


def _flag_number(extra: tuple[str, ...], flag: str, kind: type = int, absent: int | float = 1) -> int | float:
    """The value of Megatron flag ``flag`` in ``extra`` (``--flag N`` or ``--flag=N``) as ``kind``;
    ``absent`` if it is not given (``pretrain-cpu``'s own flags set no expert split and no dropout)."""
    value = flag_value(extra, flag)
    try:
        return absent if value is None else kind(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: not {'an integer' if kind is int else 'a number'}") from None


def _dropout(extra: tuple[str, ...]) -> float:
    """The attention dropout Megatron flags ``extra`` set."""
    return _flag_number(extra, "--attention-dropout", float, 0.0)


def reference_of(opts: CPURun) -> tuple[CPURun, str]:
    """The run ``--compare`` compares ``opts`` with, and how to name it: CP=1, TP=1 (the run's TP with
    Mamba or gated delta net layers, whose parameters Megatron draws per TP rank) with Megatron's local attention; where that cannot compute the model (``no_local_reference``: MLA, windows, pipeline
    stages that read no data, attention dropout), the same loop at CP=1 under HSAP (without
    HSAP's own flags, which tune a CP > 1 run). Same global batch
    and the same pipeline stages, on the data-parallel ranks — or, with experts split
    (``--expert-model-parallel-size`` E, ``--expert-tensor-parallel-size``), on as many ranks as the
    split needs, each with its share of the micro-batch. Megatron seeds a stage's layers by its
    pipeline rank and each expert by its expert-parallel rank, so the reference splits both alike
    (PP 2 × CP 1×2 against PP 1: 2e-2 apart; EP 2 over CP 2×2 against EP 1: 7.4e-3 apart from
    the first step; each against a reference split alike: equal). Raises ``ConfigError`` when the
    micro-batch does not split over those ranks, and with ``--mtp-num-layers`` when the split
    changes the micro-batch (Megatron weights MTP's loss per micro-batch)."""
    experts = _flag_number(opts.extra, "--expert-model-parallel-size") * _flag_number(opts.extra, "--expert-tensor-parallel-size")
    world = math.lcm(opts.dp_size, experts)
    share, rest = divmod(opts.micro_batch_size * opts.dp_size, world)
    if rest or not share:
        raise ConfigError(
            f"--compare: the CP=1 reference runs the experts' split ({experts} expert model-parallel ranks) on "
            f"{world} ranks, over which the global batch of {opts.micro_batch_size * opts.dp_size} samples does "
            f"not split into micro-batches; use a --micro-batch-size that makes it a multiple of {world}")
    if share != opts.micro_batch_size and flag_value(opts.extra, "--mtp-num-layers"):
        raise ConfigError(
            f"--compare with --mtp-num-layers: the reference splits each micro-batch of {opts.micro_batch_size} "
            f"samples into micro-batches of {share} (the experts' split), and Megatron weights each MTP depth's "
            "loss per micro-batch (its loss tokens before / after the shifts), so the runs would differ by that "
            "weighting alone (6.8e-5 at --micro-batch-size 2 with --expert-model-parallel-size 2): give a "
            f"--world-size whose data-parallel ranks are a multiple of the expert split ({experts}), which the "
            "reference then keeps")
    # Megatron draws each TP rank's Mamba conv / dt / A / D and gated delta net A parameters from that
    # rank's own RNG stream (MambaMixer / _GDNBase.__init__), so a TP 1 reference would start from
    # other values: keep the TP. Likewise attention dropout: each TP rank's CPU generator (whose
    # stream differs by TP rank) draws the CPU kernel's mask seeds (TP 2 × CP 2×2 vs TP 1: 4.7e-4
    # apart; vs TP 2 at CP=1: equal)
    tp = opts.tp if set(hybrid_pattern(opts.extra) or "") & set(_SCANS) or _dropout(opts.extra) > 0 else 1
    sizes = dict(tp=tp, world_size=world * opts.pp * tp, micro_batch_size=share,
                 global_batch_size=opts.global_batch_size or opts.micro_batch_size * opts.dp_size,
                 # Megatron pads the vocabulary to a multiple of this × TP: at TP=1 the run's padded size
                 vocab_multiple=opts.vocab_multiple * opts.tp // tp)
    why = no_local_reference(opts)
    if why:  # (HSAP's own flags tune a CP > 1 run: at CP=1, e.g. --hsap-head-chunks 2, they are refused)
        return (replace(opts, intra_size=1, inter_size=1, extra=tuple(drop_hsap_flags(opts.extra)), **sizes),
                "CP=1 under HSAP; " + "; ".join(why))
    # (HSAP's own flags configure the HSAP run only: a ring run refuses them)
    return replace(opts, reference=True, extra=tuple(drop_hsap_flags(opts.extra)), **sizes), "CP=1, local attention"


def compare_losses(got: dict[int, float], want: dict[int, float]) -> tuple[float, str]:
    """``(largest per-step relative difference, "")``, or ``(nan, why)`` when the runs cannot be
    compared: Megatron logs no lm loss for an iteration whose update it skipped (an fp16 loss-scale
    overflow: its ``number of skipped iterations``), so the two runs must have logged the same steps."""
    if sorted(got) != sorted(want):
        return math.nan, (f"the runs logged an lm loss at different iterations (this run {sorted(got)}, the "
                          f"reference {sorted(want)}): one skipped updates the other made")
    if not want:
        return math.nan, ("no iteration logged an lm loss: Megatron skipped every update (with --fp16 its loss "
                          "scaler starts at 2^32 and halves per overflowing step; pass --initial-loss-scale, "
                          "e.g. 1024, or more --steps)")
    return max(abs(got[i] - want[i]) / abs(want[i]) for i in want), ""
