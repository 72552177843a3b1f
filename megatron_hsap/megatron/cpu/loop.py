"""What a CPU run of Megatron's ``pretrain()`` needs besides HSAP's hooks: data, loss, reference step.

``pretrain_gpt.py`` is not in the megatron-core wheel, so the CPU command brings its own dataset
provider (megatron-core's ``GPTDataset`` over the ``train-tiny`` corpus, packed, with document
boundaries; with ``--mock-data`` its ``MockGPTDataset``, with ``--sft`` its ``SFTDataset``, as
``pretrain_gpt``'s provider picks them) and loss function, written against megatron-core APIs like Megatron-LM's own
(``pretrain_gpt.loss_func`` at ``core_v0.19.0``: Σ loss·mask, token count, and the rerun state
machine's NaN / Inf / spiky-loss checks). ``reference_forward_step`` is the CP=1 comparison: Megatron's
local ``DotProductAttention`` with the dataloader's per-document causal mask.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator

import torch

__all__ = ["cpu_datasets_provider", "cpu_loss_func", "reference_forward_step", "SPIKY_LOSS_FACTOR"]

SPIKY_LOSS_FACTOR = 10  # a loss 10× the largest seen so far is "spiky" (Megatron-LM's factor)


def _dataset_config(args: Any) -> Any:
    """``pretrain_gpt``'s dataset config over the CPU run's data: the standard-library corpus, with
    ``--mock-data`` Megatron's mock documents (no blend), with ``--sft`` the CPU conversations
    (``megatron/cpu/sft.py``; no position or mask resets: SFTDataset asserts them off)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megatron_hsap.megatron.data import ByteTokenizer, build_stdlib_corpus

    sft = bool(getattr(args, "sft", False))
    data_dir = getattr(args, "hsap_cpu_data_dir", None)
    blend, tokenizer = None, ByteTokenizer()
    if sft:
        from megatron_hsap.megatron.cpu.sft import ConversationTokenizer, build_conversations

        blend, tokenizer = ([build_conversations(data_dir)], None), ConversationTokenizer()
    elif getattr(args, "mock_data", False):
        # a mock document cycles through token ids below the tokenizer's vocab_size: below the
        # byte range, never EOD (256) or PAD (257) inside a document, where the reference's
        # EOD-built mask would end it while its cu_seqlens (the index's lengths) do not (4.4e-3 apart)
        tokenizer.vocab_size = 256
        tokenizer.unique_identifiers = {**tokenizer.unique_identifiers, "vocab_size": 256}
    else:
        # Documents of 24–160 bytes (longer blocks cut): several per 256-token sample, so batches
        # are really packed and documents span CP ranks.
        blend = ([build_stdlib_corpus(data_dir, min_doc_bytes=24, max_doc_bytes=160).prefix], None)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=args.split or "90,5,5",
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids and not sft,
        reset_attention_mask=args.reset_attention_mask and not sft,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader and not sft,
        inter_document_masking=bool(getattr(args, "dataloader_inter_document_masking", False)) and not sft,
        # as pretrain_gpt copies it; read only by SFTDataset, which pads each conversation to 2·CP
        # (under HSAP the provider runs with it at 1: pretrain_hooks.sft_data_as_cp1)
        context_parallel_size=getattr(args, "context_parallel_size", 1),
    )


def cpu_datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None) -> tuple[Any, Any, Any]:
    """``(train, valid, test)`` datasets as ``pretrain_gpt``'s provider builds them (Megatron's
    builder, ``_dataset_config``): ``GPTDataset`` s over the standard-library corpus, with
    ``--mock-data`` ``MockGPTDataset`` s, with ``--sft`` Megatron's ``SFTDataset`` over conversations
    made from the corpus (``megatron/cpu/sft.py``).

    Built on TP rank 0 of the first and last pipeline stages — with ``--sft`` of every stage
    (``pretrain_gpt.is_dataset_built_on_rank(..., is_packed_sequence=True)``: a middle stage needs
    the batch's ``cu_seqlens``); the other ranks get ``None`` and receive their batches from the
    hooks' TP broadcast.
    """
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    sft = bool(getattr(args, "sft", False))

    def built_here() -> bool:
        return (sft or is_first_or_last_pipeline_stage(vp_stage)) and parallel_state.get_tensor_model_parallel_rank() == 0

    if sft:
        from megatron_hsap.megatron.cpu.sft import sft_dataset_class

        cls, what = sft_dataset_class(), "SFT datasets (megatron-hsap CPU conversations)"
    elif getattr(args, "mock_data", False):  # Megatron's synthetic documents, as pretrain_gpt builds them
        cls, what = MockGPTDataset, "datasets (Megatron's mock data)"
    else:
        cls, what = GPTDataset, "datasets (megatron-hsap CPU corpus)"
    print_rank_0(f"> building train, validation, and test {what} ...")
    return BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, built_here, _dataset_config(args)).build()


def cpu_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: Any = None) -> tuple[Any, Any, dict]:
    """``(Σ loss·mask, loss tokens, report)`` with the rerun state machine's checks, as Megatron's.

    ``loss_mask`` / ``output_tensor`` ``[b, s]`` (``[1, t_local]`` under HSAP). With
    ``--calculate-per-token-loss`` Megatron divides by the tokens summed over DP×CP.
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    from megatron_hsap.megatron.cpu.record import record_loss, record_params

    record_params(model)
    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    record_loss(loss, num_tokens, training=bool(getattr(model, "training", True)))
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss, tolerance=0.0, fatal=False, message="Spiky loss",
            rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
        )
    return loss, num_tokens, report


def reference_forward_step(data_iterator: Iterator[dict[str, Any]] | None, model: Any,
                           return_schedule_plan: bool = False) -> tuple[Any, Any]:
    """CP=1, TP=1 forward step with the dataloader's attention mask (Megatron's local attention).

    The comparison run for HSAP: ``--reset-attention-mask --reset-position-ids`` and the mask made in
    the dataloader give every document its own causal block, which is what HSAP computes packed;
    with ``--sft`` (SFTDataset makes no mask) the same mask from the batch's ``cu_seqlens``.
    Pipeline stages: at most two (first and last both read the batch; a middle stage has no mask),
    any number with ``--sft`` (every stage reads the batch).
    """
    from megatron.core import parallel_state
    from megatron.training import get_args, get_timers

    from megatron_hsap.errors import ConfigError

    if return_schedule_plan:
        raise ConfigError("the reference forward step builds no schedule plan")
    # (with --sft every pipeline stage reads the batch, so a middle stage has its documents too)
    if (parallel_state.get_tensor_model_parallel_world_size() != 1
            or (parallel_state.get_pipeline_model_parallel_world_size() > 2 and not getattr(get_args(), "sft", False))
            or parallel_state.get_context_parallel_world_size() != 1):
        raise ConfigError("the reference forward step is for TP=1, PP ≤ 2 (any PP with --sft), CP=1 runs")
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = next(data_iterator)
    timers("batch-generator").stop()
    mask = batch.get("attention_mask")
    if mask is None and batch.get("cu_seqlens") is not None:  # --sft: SFTDataset makes no mask
        mask = document_causal_mask(batch["cu_seqlens"], batch["tokens"].shape[1])
    if mask is None:
        raise ConfigError("the reference run needs the dataloader's mask: --create-attention-mask-in-dataloader "
                          "--reset-attention-mask")
    loss_mask = batch["loss_mask"]
    with _mtp_shifts_inside_documents(mask, bool(getattr(get_args(), "mtp_num_layers", None))):
        output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"], loss_mask=loss_mask)
    return output, partial(cpu_loss_func, loss_mask, model=model)


@contextlib.contextmanager
def _mtp_shifts_inside_documents(mask: torch.Tensor, mtp: bool) -> Iterator[None]:
    """Multi-token prediction's shifts in the reference, inside each document as Megatron's own
    packed-sequence ``roll_tensor`` does at CP=1 (``_roll_tensor_packed_seq``: a document's last
    token gets 0) — what HSAP's packed batch computes. The reference has no ``packed_seq_params``
    (local attention takes a mask), so Megatron would shift the ``[b, s]`` rows across documents;
    for the forward pass, ``roll_tensor`` is Megatron's own given the documents of the reference's
    attention mask ``[b, 1, s, s]`` (a document starts where a token may not see the one before it),
    over the rows packed in order."""
    if not mtp:
        yield
        return
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import multi_token_prediction as mtp_module

    from megatron_hsap.errors import ConfigError

    b, s = mask.shape[0], mask.shape[-1]
    rows = torch.arange(b)[:, None]
    cut = mask[rows, 0, torch.arange(1, s)[None, :], torch.arange(s - 1)[None, :]]  # [b, s-1]: i cannot see i-1
    starts = torch.cat([torch.ones(b, 1, dtype=torch.bool), cut.to(torch.bool)], dim=1).reshape(-1)
    cu = torch.cat([torch.nonzero(starts).view(-1), torch.tensor([b * s])]).to(torch.int64)
    installed = mtp_module.roll_tensor
    megatron_roll = getattr(installed, "__hsap_original__", installed)

    def roll_tensor(tensor: Any, shifts: int = -1, dims: int = -1, cp_group: Any = None,
                    packed_seq_params: Any = None) -> Any:
        if tensor is None:
            return None, None
        if tensor.numel() != b * s:  # (a mask shared by the rows would leave rows unshifted)
            raise ConfigError(f"the reference's MTP shift got {tuple(tensor.shape)} for a [{b}, {s}] mask: give each "
                              "sample its own mask (--reset-attention-mask)")
        rolled, _ = megatron_roll(tensor.reshape(1, -1), shifts=shifts, dims=-1,
                                  packed_seq_params=PackedSeqParams(cu_seqlens_q=cu))
        rolled = rolled.reshape(tensor.shape)
        return rolled, rolled.sum()

    mtp_module.roll_tensor = roll_tensor
    try:
        yield
    finally:
        mtp_module.roll_tensor = installed


def document_causal_mask(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """``[b, 1, s, s]`` bool, True where a query must not see a key (Megatron's mask convention, as
    ``GPTDataset`` builds it with ``--reset-attention-mask``): causal inside each document of the
    per-sample ``cu_seqlens`` rows ``[b, n]`` (right-padded with ``s``, as ``SFTDataset`` returns them)."""
    rows = cu_seqlens.reshape(-1, cu_seqlens.shape[-1]).to(torch.int64)
    pos = torch.arange(seq_length, device=rows.device)
    # a token's document: the number of boundaries at or before it (the padded ends never count)
    doc = (rows[:, 1:, None] <= pos[None, None, :]).sum(dim=1)  # [b, s]
    same = doc[:, :, None] == doc[:, None, :]
    causal = pos[None, :, None] >= pos[None, None, :]
    return ~(same & causal)[:, None]
