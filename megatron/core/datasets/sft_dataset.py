"""SFTDataset: chat examples (prompt + answer tokens) as fixed-length training rows.

The corpus is a token pair written by `tools/preprocess_data.py --chat` plus its answer-mask
pair (`indexed_dataset.get_answer_prefix`): one sequence per example, and per token 1 where it
is an answer (maskable, a target) and 0 in the prompt. `--sft-padding` chooses how examples
become rows of seq_length + 1 tokens (the extra one is the AR shift, as in GPTDataset):

- `eos` (LLaDA): one example per row, cut to the row and right-padded with EOD. The padding is
  answer: a DLM learns to emit EOD to end its reply (LLaDA's variable length), and no attention
  mask hides it. `padding` marks it so AR fine-tuning leaves it out of its loss.
- `pack`: whole examples packed in order into rows of seq_length tokens (an example longer than
  that is cut), the rest EOD filler that is neither answer nor attended: `document_ids` number
  the examples of a row (the filler gets its own id), so attention stays inside each example.

Rows are a pure function of (the split's examples, seed, seq_length, padding): every epoch is a
fresh permutation of the examples (numpy RandomState(seed), as GPTDataset), and packing walks
that order, so every rank builds the same rows without communication or cache files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import (IndexedDataset, get_answer_prefix, get_bin_path, out_of_vocabulary,
                                                    vocabulary_error)
from megatron.core.errors import InputError

SFT_PADDINGS = ("eos", "pack")

Example = Tuple[np.ndarray, np.ndarray]
"""(token ids, answer flags) of one example, equal lengths."""


@dataclass
class SFTDatasetConfig:
    seq_length: int
    """Tokens per row fed to the model; each row carries one more for the AR shift."""
    eod: int
    """Padding id (the tokenizer's EOD)."""
    padding: str = "eos"
    """eos (LLaDA: one example per row, EOD-padded, the padding trained) or pack (per-example attention)."""
    seed: int = 1234
    """Seed of the per-epoch example permutations."""


def epoch_order(num_examples: int, num_epochs: int, seed: int) -> np.ndarray:
    """The examples of `num_epochs` epochs, each epoch its own permutation."""
    rng = np.random.RandomState(seed)
    return np.concatenate([rng.permutation(num_examples) for _ in range(num_epochs)]).astype(np.int64)


def pack_rows(lengths: np.ndarray, order: np.ndarray, capacity: int) -> List[np.ndarray]:
    """Rows of whole examples in `order` (next fit: an example that does not fit opens a row);
    an example longer than `capacity` fills a row alone and is cut."""
    rows, current, used = [], [], 0
    for example in order.tolist():
        length = min(int(lengths[example]), capacity)
        if current and used + length > capacity:
            rows.append(np.asarray(current, dtype=np.int64))
            current, used = [], 0
        current.append(example)
        used += length
    if current:
        rows.append(np.asarray(current, dtype=np.int64))
    return rows


class SFTDataset(torch.utils.data.Dataset):
    """`num_samples` rows of seq_length + 1 tokens from the examples `get(0 .. len(lengths) - 1)`.

    Each item: tokens int64, answer bool, padding bool and document_ids int64, all [seq_length + 1].
    """

    def __init__(self, lengths: np.ndarray, get: Callable[[int], Example], num_samples: int,
                 config: SFTDatasetConfig, name: str = "sft", source: Optional[Dict] = None) -> None:
        if config.padding not in SFT_PADDINGS:
            raise ValueError(f"SFTDatasetConfig.padding={config.padding!r} is not one of {list(SFT_PADDINGS)}")
        if len(lengths) == 0:
            raise InputError(f"{name}: no examples in this split; check --split or the data")
        self.lengths, self.get, self.config, self.name = np.asarray(lengths, dtype=np.int64), get, config, name
        self.num_samples = num_samples
        self.rows = self._build_rows()
        self.truncated = int((self.lengths > self._capacity).sum())
        """Examples longer than a row (cut to fit)."""
        description = {"class": "SFTDataset", "source": source or name, "examples": len(self.lengths),
                       "tokens": int(self.lengths.sum()), "num_samples": num_samples, **asdict(config)}
        self.unique_key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]
        """Names the rows in a blend's cache (BlendedDataset)."""

    @property
    def _capacity(self) -> int:
        # eos: the example may use the AR shift's extra token; pack: the last token is always filler.
        return self.config.seq_length + (1 if self.config.padding == "eos" else 0)

    def _build_rows(self):
        examples = len(self.lengths)
        if self.config.padding == "eos":
            return epoch_order(examples, max(1, -(-self.num_samples // examples)), self.config.seed)
        rows, rng = [], np.random.RandomState(self.config.seed)
        while len(rows) < max(self.num_samples, 1):
            # Each epoch packs on its own (epoch_order's permutations, drawn one at a time), so the
            # rows of epoch e do not depend on how many follow.
            rows += pack_rows(self.lengths, rng.permutation(examples).astype(np.int64), self._capacity)
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def _row_examples(self, index: int) -> List[int]:
        if self.config.padding == "eos":
            return [int(self.rows[index])]
        return self.rows[index].tolist()

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        size = self.config.seq_length + 1
        tokens = np.full(size, self.config.eod, dtype=np.int64)
        answer = np.zeros(size, dtype=bool)
        documents = np.zeros(size, dtype=np.int64)
        filled = 0
        for number, example in enumerate(self._row_examples(index)):
            ids, flags = self.get(example)
            length = min(len(ids), self._capacity - filled)
            tokens[filled:filled + length] = ids[:length]
            answer[filled:filled + length] = flags[:length]
            documents[filled:filled + length] = number
            filled += length
        padding = np.zeros(size, dtype=bool)
        padding[filled:] = True
        if self.config.padding == "eos":
            answer[filled:] = True       # LLaDA: the EOD padding is part of the answer
        else:
            documents[filled:] = documents[filled - 1] + 1 if filled else 0
        return {"tokens": torch.from_numpy(tokens), "answer": torch.from_numpy(answer),
                "padding": torch.from_numpy(padding), "document_ids": torch.from_numpy(documents),
                "index": torch.tensor(index, dtype=torch.int64)}


def indexed_examples(tokens: IndexedDataset, answers: IndexedDataset, document_range: Tuple[int, int],
                     vocab_size: Optional[int] = None) -> Tuple[np.ndarray, Callable[[int], Example]]:
    """(lengths, get) of the examples [begin, end) of a token pair and its answer pair; `get` checks
    each example's ids against [0, vocab_size) (GPTDatasetConfig.vocab_size)."""
    begin, end = document_range

    def get(example: int) -> Example:
        ids = tokens.get(begin + example)
        bad = out_of_vocabulary(ids, vocab_size)
        if bad is not None:
            raise vocabulary_error(f"{get_bin_path(tokens.path_prefix)}, sequence {begin + example}", bad, vocab_size)
        return ids, answers.get(begin + example)
    return np.asarray(tokens.sequence_lengths[begin:end]), get


def check_answer_pair(prefix: str, mmap: bool = True) -> Tuple[IndexedDataset, IndexedDataset]:
    """The token pair and its answer pair, or an InputError naming the file and the fix."""
    answer_prefix = get_answer_prefix(prefix)
    if not IndexedDataset.exists(answer_prefix):
        raise InputError(f"--sft: {answer_prefix}.bin / .idx not found beside {prefix}; build SFT data with "
                         "tools/preprocess_data.py --chat (it writes both pairs)")
    tokens, answers = IndexedDataset(prefix, mmap=mmap), IndexedDataset(answer_prefix, mmap=mmap)
    if len(tokens) != len(answers) or not np.array_equal(tokens.sequence_lengths, answers.sequence_lengths):
        raise InputError(f"--sft: {answer_prefix} does not match {prefix} (its sequence lengths differ): the pairs "
                         "come from different runs; rebuild both with tools/preprocess_data.py --chat")
    return tokens, answers
