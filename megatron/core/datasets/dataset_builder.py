"""Train/valid/test datasets from Megatron's data flags.

`--data-path a` | `--data-path a b` | `--data-path 0.7 a 0.3 b` with `--split 969,30,1`:
every prefix is split into three document ranges and each split blends the prefixes with
the weights. `--train-data-path/--valid-data-path/--test-data-path` give each split its own
(weighted) list instead. A blend asks each component for ceil(ceil(S * w) * 1.005) samples,
as Megatron does, so rounding never leaves the blend short.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

from megatron.core.datasets import indexed_dataset
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, split_document_ranges
from megatron.core.datasets.indexed_dataset import IndexedDataset, check_indexed_dataset, get_answer_prefix
from megatron.core.datasets.sft_dataset import SFTDataset, SFTDatasetConfig, check_answer_pair, indexed_examples
from megatron.core.errors import InputError

SPLIT_NAMES = ("train", "valid", "test")
BLEND_SURPLUS = 0.005


def parse_data_paths(values: Sequence[str], flag: str = "--data-path") -> Tuple[List[str], List[float]]:
    """`a b` -> equal weights; `0.7 a 0.3 b` -> those weights (normalised)."""
    values = list(values)
    if not values:
        raise InputError(f"{flag} is empty")
    if len(values) == 1:
        return values, [1.0]
    try:
        float(values[0])
        weighted = True
    except ValueError:
        weighted = False
    if not weighted:
        return values, [1.0 / len(values)] * len(values)
    if len(values) % 2:
        raise InputError(f"{flag} with weights takes pairs 'weight prefix ...', got {len(values)} values")
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise InputError(f"{flag}: every other value must be a weight, got {values[0::2]}") from None
    total = sum(weights)
    if total <= 0 or any(w <= 0 for w in weights):
        raise InputError(f"{flag} weights must be positive, got {weights}")
    return values[1::2], [w / total for w in weights]


def check_prefixes_exist(prefixes: Sequence[str], flag: str, sft: bool = False) -> None:
    """Every prefix is a present, undamaged, non-empty pair (with `sft`, its answer pair too, with
    as many documents); InputError naming `flag` otherwise.

    Called when the flags are parsed, so a bad corpus stops the run before a model is built;
    the check reads headers and sizes only (see check_indexed_dataset).
    """
    for prefix in prefixes:
        documents = _checked_documents(prefix, flag, "give the prefix written by tools/preprocess_data.py (e.g. "
                                                     "corpus_text_document)")
        if documents == 0:
            raise InputError(f"{flag}: {prefix}.bin / {prefix}.idx holds no documents; re-run "
                             "tools/preprocess_data.py on an input with at least one document")
        if not sft:
            continue
        answers = get_answer_prefix(prefix)
        if _checked_documents(answers, flag, f"--sft needs it beside {prefix}; build the data with "
                                             "tools/preprocess_data.py --chat (it writes both pairs)") != documents:
            raise InputError(f"{flag}: {answers} does not hold the {documents} documents of {prefix}: the pairs "
                             "come from different runs; rebuild both with tools/preprocess_data.py --chat")


def check_leading_tokens(prefixes: Sequence[str], flag: str, vocab_size: int) -> None:
    """The first tokens of every prefix fit this run's vocabulary (indexed_dataset.check_leading_tokens),
    or an InputError naming `flag`. Called once the tokenizer is known, with the other flag checks."""
    for prefix in prefixes:
        try:
            indexed_dataset.check_leading_tokens(prefix, vocab_size)
        except InputError as error:
            raise InputError(f"{flag}: {error}") from None


def _checked_documents(prefix: str, flag: str, fix_if_missing: str) -> int:
    """The documents of an undamaged pair (check_indexed_dataset), or an InputError naming `flag`."""
    if not IndexedDataset.exists(prefix):
        raise InputError(f"{flag}: {prefix}.bin / {prefix}.idx not found; {fix_if_missing}")
    try:
        return check_indexed_dataset(prefix)
    except InputError as error:
        raise InputError(f"{flag}: {error}") from None


class DatasetBuilder:
    """Datasets of GPTDataset samples, or with `sft` of SFTDataset rows (chat examples)."""

    def __init__(self, config: GPTDatasetConfig, barrier: Optional[Callable[[], None]] = None,
                 is_builder: bool = True, sft: Optional[SFTDatasetConfig] = None) -> None:
        self.config, self.barrier, self.is_builder, self.sft = config, barrier, is_builder, sft
        self._indexed = {}

    def indexed(self, prefix: str) -> IndexedDataset:
        if prefix not in self._indexed:
            self._indexed[prefix] = IndexedDataset(prefix, mmap=self.config.mmap_bin_files)
        return self._indexed[prefix]

    def gpt(self, prefix: str, document_range: Tuple[int, int], num_samples: int, split: str):
        if self.sft is not None:
            tokens, answers = check_answer_pair(prefix, mmap=self.config.mmap_bin_files)
            lengths, get = indexed_examples(tokens, answers, document_range, self.config.vocab_size)
            dataset = SFTDataset(lengths, get, num_samples, self.sft, name=f"{prefix} ({split})",
                                 source={"prefix": prefix, "range": list(document_range), "split": split})
            if dataset.truncated and self.is_builder:
                print(f"note: {prefix} ({split}): {dataset.truncated} of {len(lengths)} examples are longer than a "
                      f"row of --seq-length {self.sft.seq_length} tokens and are cut", flush=True)
            return dataset
        return GPTDataset(self.indexed(prefix), prefix, document_range, num_samples, self.config, split,
                          barrier=self.barrier, is_builder=self.is_builder)

    def blend(self, parts: List[Tuple[str, Tuple[int, int]]], weights: List[float], size: int, split: str):
        if len(parts) == 1:
            return self.gpt(parts[0][0], parts[0][1], size, split)
        datasets = [self.gpt(prefix, document_range, math.ceil(math.ceil(size * w) * (1 + BLEND_SURPLUS)), split)
                    for (prefix, document_range), w in zip(parts, weights)]
        return BlendedDataset(datasets, weights, size, cache_dir=self.config.cache_dir or None,
                              barrier=self.barrier, is_builder=self.is_builder)

    def from_split(self, data_path: Sequence[str], split: str, sizes: Sequence[int]) -> List:
        prefixes, weights = parse_data_paths(data_path)
        ranges = {prefix: split_document_ranges(len(self.indexed(prefix)), split)
                  for prefix in prefixes}
        datasets = []
        for index, (name, size) in enumerate(zip(SPLIT_NAMES, sizes)):
            empty = all(ranges[p][index][1] <= ranges[p][index][0] for p in prefixes)
            if empty and size > 0 and name == "train":  # validation and test may be left out; training not
                counts = ", ".join(f"{p}: {len(self.indexed(p))} documents" for p in prefixes)
                raise InputError(f"--split {split} leaves the train split no documents ({counts}); "
                                 "raise the first --split weight or use more data")
            if size <= 0 or empty:
                datasets.append(None)
                continue
            parts = [(p, ranges[p][index]) for p in prefixes]
            datasets.append(self.blend(parts, weights, size, name))
        return datasets

    def from_split_paths(self, paths: Sequence[Optional[Sequence[str]]], sizes: Sequence[int]) -> List:
        datasets = []
        for name, values, size in zip(SPLIT_NAMES, paths, sizes):
            if not values or size <= 0:
                datasets.append(None)
                continue
            prefixes, weights = parse_data_paths(values, f"--{name}-data-path")
            parts = [(p, (0, len(self.indexed(p)))) for p in prefixes]
            datasets.append(self.blend(parts, weights, size, name))
        return datasets
