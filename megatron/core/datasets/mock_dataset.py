"""Deterministic synthetic documents, so every feature can run without a corpus.

Sample i is a pure function of (seed, split, i): a row of seq_length + 1 tokens made of
EOD-separated documents in a tiny learnable language (each document counts from a random
start with a random stride, modulo the text vocabulary). A model can lower its loss on it
quickly, which makes "the loss falls" a meaningful smoke test.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

SPLITS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, text_vocab_size: int, eod: int, seed: int = 1234,
                 split: str = "train", mean_document_length: int = 0) -> None:
        if text_vocab_size < 2:
            raise ValueError(f"text_vocab_size={text_vocab_size} must be >= 2")
        self.num_samples, self.seq_length = num_samples, seq_length
        self.text_vocab_size, self.eod, self.seed = text_vocab_size, eod, seed
        self.split_id = SPLITS[split]
        self.mean_document_length = mean_document_length or max(2, seq_length // 2)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"mock sample {index} outside [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split_id, index])
        tokens = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        while filled < tokens.size:
            length = int(rng.integers(2, 2 * self.mean_document_length))
            start = int(rng.integers(0, self.text_vocab_size))
            stride = int(rng.integers(1, 8))
            document = (start + stride * np.arange(length)) % self.text_vocab_size
            piece = np.append(document, self.eod)[: tokens.size - filled]
            tokens[filled: filled + piece.size] = piece
            filled += piece.size
        return {"tokens": torch.from_numpy(tokens), "index": torch.tensor(index, dtype=torch.int64)}


MOCK_SFT_EXAMPLES = 1024


def mock_sft_examples(seq_length: int, text_vocab_size: int, eod: int, seed: int = 1234, split: str = "train",
                      num_examples: int = MOCK_SFT_EXAMPLES):
    """(lengths, get) of synthetic chat examples for `--mock-data --sft` (SFTDataset's source).

    Example j: a prompt counting from a random start with a random stride, then the answer: the
    count continued, ended by EOD. Lengths are drawn up front (packing needs them), contents per
    example from (seed, split, j), so every rank and layout sees the same examples.
    """
    rng = np.random.default_rng([seed, SPLITS[split], 0])
    low = max(2, seq_length // 8)
    prompts = rng.integers(1, low + 1, num_examples)
    answers = rng.integers(1, max(2, seq_length // 2), num_examples)

    def get(example: int):
        draw = np.random.default_rng([seed, SPLITS[split], 1, example])
        start, stride = int(draw.integers(0, text_vocab_size)), int(draw.integers(1, 8))
        prompt, answer = int(prompts[example]), int(answers[example])
        ids = np.append((start + stride * np.arange(prompt + answer)) % text_vocab_size, eod).astype(np.int64)
        flags = np.zeros(ids.size, dtype=np.uint8)
        flags[prompt:] = 1
        return ids, flags
    return prompts + answers + 1, get
