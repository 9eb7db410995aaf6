"""GPTDataset: fixed-length samples cut from the concatenated documents of an indexed dataset.

Three index arrays, all pure functions of (documents of the split, number of samples,
sequence length, seed), built once by rank 0 and cached as .npy files named by a hash of
those inputs:

- document_index: the split's document ids, repeated for as many epochs as needed and
  shuffled (a final partial epoch below 80% is shuffled on its own, so a partial epoch does
  not oversample a random subset of documents mixed into the earlier ones);
- sample_index [num_samples + 1, 2]: where sample j starts, as (position in document_index,
  token offset). Sample j covers global tokens [j * L, j * L + L]: L + 1 tokens, the last
  shared with the next sample, as in Megatron (AR uses the shift, DLMs the first L);
- shuffle_index: the order samples are served in.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, out_of_vocabulary, vocabulary_error
from megatron.core.errors import InputError

INDEX_FORMAT_VERSION = 1
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.8


@dataclass
class GPTDatasetConfig:
    seq_length: int
    """Tokens per sample fed to the model; each sample carries one more for the AR shift."""
    seed: int = 1234
    """Seed of the document and sample shuffles."""
    cache_dir: Optional[str] = None
    """Where index files go (default: `<data prefix dir>/cache/GPTDataset_indices`)."""
    mmap_bin_files: bool = True
    """Memory-map the `.bin` token files; False reads each sample through a file handle
    (--no-mmap-bin-files, for filesystems where mmap is slow or not allowed)."""
    vocab_size: Optional[int] = None
    """Ids a sample may hold, [0, vocab_size) (the tokenizer's, without padding or an appended mask
    token); every piece read is checked against it. None: unchecked."""


def split_weights(split: str) -> List[float]:
    """`--split 949,50,1` -> the train, valid and test weights (missing ones are 0)."""
    try:
        weights = [float(part) for part in split.replace("/", ",").split(",")]
    except ValueError:
        raise InputError(f"--split {split!r} must be comma-separated numbers such as 949,50,1") from None
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    # Chained comparisons: NaN and inf fail them too.
    if not all(0.0 <= w < float("inf") for w in weights) or sum(weights) <= 0:
        raise InputError(f"--split {split!r} needs finite non-negative weights with a positive sum")
    return weights


def split_document_ranges(num_documents: int, split: str) -> Tuple[Tuple[int, int], ...]:
    """`--split 949,50,1` -> contiguous [begin, end) document ranges for train, valid, test."""
    weights = split_weights(split)
    total = sum(weights)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight / total * num_documents)))
    bounds = [min(b, num_documents) for b in bounds]
    bounds[-1] = num_documents
    return tuple((bounds[i], bounds[i + 1]) for i in range(3))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents, num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    head = build_document_index(documents, num_epochs - 1, rng, False)
    tail = build_document_index(documents, 1, rng, False)
    return np.concatenate([head, tail])


def build_sample_index(lengths_in_order: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Row j = (position in the document index, offset) of global token j * seq_length."""
    cumulative = np.concatenate([[0], np.cumsum(lengths_in_order, dtype=np.int64)])
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" - 1 skips empty documents: the start lands in the first non-empty one.
    positions = np.searchsorted(cumulative, starts, side="right") - 1
    positions = np.minimum(positions, len(lengths_in_order) - 1)
    offsets = starts - cumulative[positions]
    return np.stack([positions, offsets], axis=1).astype(np.int64)


def build_shuffle_index(num_samples: int, num_full_epoch_samples: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if num_samples < 2 ** 32 - 1 else np.int64
    first = np.arange(num_full_epoch_samples, dtype=dtype)
    rng.shuffle(first)
    rest = np.arange(num_full_epoch_samples, num_samples, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate([first, rest])


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` samples of seq_length + 1 tokens from documents [begin, end) of `indexed`."""

    def __init__(self, indexed: IndexedDataset, path_prefix: str, document_range: Tuple[int, int],
                 num_samples: int, config: GPTDatasetConfig, split_name: str = "train",
                 barrier: Optional[Callable[[], None]] = None, is_builder: bool = True) -> None:
        self.indexed, self.path_prefix, self.config = indexed, path_prefix, config
        self.document_range, self.split_name = document_range, split_name
        begin, end = document_range
        if end <= begin:
            raise InputError(f"{path_prefix}: the {split_name} split has no documents ({document_range}); "
                             "check --split")
        self.documents = np.arange(begin, end, dtype=np.int32)
        tokens_per_epoch = int(indexed.sequence_lengths[begin:end].sum())
        if tokens_per_epoch <= config.seq_length:
            raise InputError(f"{path_prefix}: the {split_name} split holds {tokens_per_epoch} tokens, fewer than "
                             f"one sample of --seq-length {config.seq_length} + 1")
        self.requested_samples = num_samples
        self.built_now = False
        """True when this process built the indices (False when they came from the cache)."""
        self.description = self._description(tokens_per_epoch)
        self.unique_key = hashlib.sha256(json.dumps(self.description, sort_keys=True).encode()).hexdigest()[:32]
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(
            tokens_per_epoch, barrier, is_builder)

    def _description(self, tokens_per_epoch: int) -> Dict:
        # What the indices depend on: not where they are cached, nor the vocabulary the reads are checked against.
        config = {name: value for name, value in asdict(self.config).items() if name != "vocab_size"}
        return {"class": "GPTDataset", "format": INDEX_FORMAT_VERSION, "path_prefix": os.path.abspath(self.path_prefix),
                "document_range": list(self.document_range), "tokens_per_epoch": tokens_per_epoch,
                "num_samples": self.requested_samples, "split": self.split_name, **config, "cache_dir": None}

    def _cache_paths(self) -> Dict[str, str]:
        cache_dir = self.config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(self.path_prefix)),
                                                          "cache", "GPTDataset_indices")
        stem = os.path.join(cache_dir, f"{self.unique_key}-GPTDataset-{self.split_name}")
        return {name: f"{stem}-{name}.npy" for name in ("document_index", "sample_index", "shuffle_index")} | {
            "description": f"{stem}-description.json"}

    def _load_or_build(self, tokens_per_epoch: int, barrier, is_builder: bool):
        paths = self._cache_paths()
        if is_builder and not all(os.path.exists(p) for p in paths.values()):
            self._build_and_save(tokens_per_epoch, paths)
        if barrier is not None:
            barrier()  # the other ranks read what the builder wrote
        missing = [p for p in paths.values() if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"GPTDataset index file {missing[0]} is missing: the building rank did not "
                                    "write it (is --data-cache-path on a filesystem every rank can read?)")
        return tuple(np.load(paths[name], mmap_mode="r")
                     for name in ("document_index", "sample_index", "shuffle_index"))

    def _build_and_save(self, tokens_per_epoch: int, paths: Dict[str, str]) -> None:
        start = time.time()
        seq_length, num_samples = self.config.seq_length, self.requested_samples
        num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = False
        if num_epochs > 1:
            # How much of the last epoch is actually used: below the threshold it is kept apart.
            last_epoch_samples = num_samples - ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
            separate = last_epoch_samples < SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch
        rng = np.random.RandomState(self.config.seed)
        document_index = build_document_index(self.documents, num_epochs, rng, separate)
        lengths = self.indexed.sequence_lengths[document_index]
        total_samples = (int(lengths.sum()) - 1) // seq_length
        sample_index = build_sample_index(lengths, seq_length, total_samples)
        full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total_samples
        shuffle_index = build_shuffle_index(total_samples, full_epochs, rng)
        os.makedirs(os.path.dirname(paths["description"]), exist_ok=True)
        for name, array in (("document_index", document_index), ("sample_index", sample_index),
                            ("shuffle_index", shuffle_index)):
            _atomic_save(paths[name], array)
        with open(paths["description"] + ".tmp", "w") as handle:
            json.dump(self.description | {"num_epochs": num_epochs, "separate_final_epoch": separate,
                                          "build_seconds": round(time.time() - start, 3)}, handle, indent=1)
        os.replace(paths["description"] + ".tmp", paths["description"])
        self.built_now = True

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, index: int) -> np.ndarray:
        j = int(self.shuffle_index[index])
        (first_pos, first_offset), (last_pos, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        first_pos, first_offset, last_pos, last_offset = (int(v) for v in (first_pos, first_offset, last_pos,
                                                                           last_offset))
        # (position in the document index, offset, length or None for the rest of the sequence)
        if first_pos == last_pos:
            windows = [(first_pos, first_offset, last_offset - first_offset + 1)]
        else:
            windows = [(first_pos, first_offset, None), *((pos, 0, None) for pos in range(first_pos + 1, last_pos)),
                       (last_pos, 0, last_offset + 1)]
        pieces = [self._read(int(self.document_index[pos]), offset, length) for pos, offset, length in windows]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _read(self, sequence: int, offset: int, length: Optional[int]) -> np.ndarray:
        tokens = self.indexed.get(sequence, offset, length)
        bad = out_of_vocabulary(tokens, self.config.vocab_size)
        if bad is not None:
            raise vocabulary_error(f"{get_bin_path(self.path_prefix)}, sequence {sequence}", bad,
                                   self.config.vocab_size)
        return tokens

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        tokens = self.sample_tokens(index)
        return {"tokens": torch.from_numpy(tokens.astype(np.int64)), "index": torch.tensor(index, dtype=torch.int64)}


def _atomic_save(path: str, array: np.ndarray) -> None:
    """Write to a temporary name and rename: a reader never sees a half-written index."""
    temporary = path + ".tmp.npy"
    np.save(temporary, array)
    os.replace(temporary, path)
