"""Megatron's SFT data (``--sft``) on CPU ranks: conversations packed by Megatron's own ``SFTDataset``.

``pretrain_gpt.py --sft`` builds ``megatron.training.datasets.sft_dataset.SFTDataset`` over a jsonl
of conversations (``{"messages": [system, user, assistant, ...]}``; a line holds several
conversations, each starting with its system turn) with ``SFTTokenizer`` (a HuggingFace tokenizer
and a chat template). Its ``__getitem__`` is what HSAP meets: conversations packed into one
``seq_length`` sample, each padded to a multiple of ``2 × CP`` when CP > 1 (pad tokens inside the
conversation, positions running on, loss-masked), the last one truncated, ``cu_seqlens`` right-padded
with ``seq_length`` to ``seq_length + 1`` entries, and the prompt turns' labels ``IGNORE_INDEX``
(loss-masked). Here that ``__getitem__`` runs unchanged; only the two things that need libraries a
CPU test machine does not have are replaced: the low-level dataset reads the jsonl with ``json``
(Megatron's uses ``datasets.load_dataset``), and the tokenizer is byte-wise
(:class:`ConversationTokenizer`: the ``nemotron-h-aligned`` prompt format's masking — system and
user turns masked, assistant turns learned — with a text template instead of special tokens).
The conversations are made from the standard-library corpus of ``megatron/data.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsap.megatron.data import ByteTokenizer, default_cache_dir

__all__ = ["ConversationTokenizer", "build_conversations", "sft_dataset_class", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # megatron/training/datasets/sft_dataset.py and SFTTokenizer: a masked label

# (role -> text before and after the content): nemotron-h-aligned's layout in plain text
_TEMPLATE = {"system": (b"System\n", b"\n"), "user": (b"User\n", b"\nAssistant\n"), "assistant": (b"", b"\n")}


class ConversationTokenizer(ByteTokenizer):
    """:class:`ByteTokenizer` with ``SFTTokenizer.tokenize_conversation`` (what ``SFTDataset`` calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.unique_identifiers = {"class": "megatron_hsap.ConversationTokenizer", "vocab_size": self.vocab_size}

    def tokenize_conversation(self, conversation: list[dict], return_target: bool, add_generation_prompt: bool):
        """Token ids ``[n]`` of ``conversation`` (and with ``return_target`` the targets: the
        system and user turns ``IGNORE_INDEX``, as ``SFTTokenizer`` masks them)."""
        tokens: list[int] = []
        target: list[int] = []
        for turn in conversation:
            role = turn["role"].lower()
            if role not in _TEMPLATE:
                raise ValueError(f"Wrong role value: {role!r}")
            before, after = _TEMPLATE[role]
            ids = list(before + turn["content"].strip().encode("utf-8") + after)
            tokens += ids
            target += ids if role == "assistant" else [IGNORE_INDEX] * len(ids)
        if add_generation_prompt:
            tokens += list(b"Assistant\n")
        out = np.array(tokens, dtype=np.int64)
        return (out, np.array(target, dtype=np.int64)) if return_target else out


def build_conversations(out_dir: str | os.PathLike[str] | None = None, *, lines: int = 400, seed: int = 1234) -> str:
    """Write (once) a jsonl of ``lines`` lines, each 3–6 conversations (system, user, assistant;
    every fourth one a second user/assistant turn) whose turns are 8–48 bytes of standard-library
    source blocks: 50–150 tokens per conversation, so a 256-token sample packs several, some lines
    are truncated, others padded. Returns its path (idempotent; safe from several processes)."""
    from megatron_hsap.megatron.data import source_documents, stdlib_sources

    files = stdlib_sources(400_000)
    # (the corpus is this Python's standard library: its version and files name the cache, as build_stdlib_corpus's)
    key = hashlib.sha256(repr((sys.version, [f.name for f in files], lines, seed)).encode()).hexdigest()[:12]
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / "data"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"conversations-{key}.jsonl"
    if path.exists():
        return str(path)
    rng = np.random.default_rng(seed)
    texts = [doc.decode("utf-8", errors="replace") for f in files for doc in source_documents(f.read_bytes(), 12, 120)]
    take = iter(rng.permutation(len(texts)).tolist() * 4)

    def turn(role: str) -> dict:  # 8-48 bytes of a block (turns short enough that several share a sample)
        return {"role": role, "content": texts[next(take)].strip()[: int(rng.integers(8, 49))].strip() or "pass"}

    rows = []
    for _ in range(lines):
        messages: list[dict] = []
        for c in range(int(rng.integers(3, 7))):
            messages += [turn("system"), turn("user"), turn("assistant")]
            if c % 4 == 3:
                messages += [turn("user"), turn("assistant")]
        rows.append(json.dumps({"messages": messages}))
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".conversations-")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(rows) + "\n")
    os.replace(tmp, path)
    return str(path)


class _JsonlConversations:
    """``SFTLowLevelDataset`` without the ``datasets`` library: line ``i``'s ``messages``."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            self._lines = [json.loads(line)["messages"] for line in f if line.strip()]

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, idx: int) -> list:
        return self._lines[idx]


def sft_dataset_class() -> type:
    """Megatron's ``SFTDataset`` with the jsonl read by ``json`` (its ``__getitem__`` unchanged)."""
    from megatron.training.datasets.sft_dataset import SFTDataset

    class CPUSFTDataset(SFTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path: str, config: Any) -> _JsonlConversations:
            return _JsonlConversations(dataset_path)

    return CPUSFTDataset
