"""Megatron .bin/.idx: exact bytes, round trips, merging, dtype limits, and every load-time check.

Expected bytes are packed here with struct from the spec (reference/frameworks.md 2.1), not
with the module's own constants, so a layout mistake in the module cannot cancel out.
"""

import os
import pickle
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)

# Three documents; the second is two sequences. uint16, so 65535 is the largest id.
TINY_DOCUMENTS = [[[1, 2, 3]], [[10, 11], [12]], [[65535, 0]]]
TINY_LENGTHS = [3, 2, 1, 2]
TINY_POINTERS = [0, 6, 10, 12]  # bytes: cumulative length * 2
TINY_DOC_INDICES = [0, 1, 3, 4]
# Field offsets in the tiny .idx: header 34 bytes, then 4*S, 8*S, 8*D with S = D = 4.
LENGTHS_AT, POINTERS_AT, DOCS_AT, IDX_END = 34, 50, 82, 114


def write_dataset(prefix, documents, dtype):
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for sequences in documents:
        for sequence in sequences:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def random_documents(rng, count, high):
    """Documents of 1-3 sequences, lengths 0..20 so empty sequences occur."""
    return [[rng.integers(0, high, size=rng.integers(0, 21)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(count)]


@pytest.fixture
def tiny(tmp_path):
    return write_dataset(str(tmp_path / "tiny"), TINY_DOCUMENTS, np.uint16)


def test_tiny_corpus_bytes_are_pinned(tiny):
    expected_idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                    + struct.pack("<Q", 4) + struct.pack("<Q", 4)
                    + struct.pack("<4i", *TINY_LENGTHS)
                    + struct.pack("<4q", *TINY_POINTERS)
                    + struct.pack("<4q", *TINY_DOC_INDICES))
    assert len(expected_idx) == IDX_END
    assert read_bytes(get_idx_path(tiny)) == expected_idx
    assert read_bytes(get_bin_path(tiny)) == struct.pack("<8H", 1, 2, 3, 10, 11, 12, 65535, 0)


def test_tiny_corpus_reads_back(tiny):
    dataset = IndexedDataset(tiny)
    assert len(dataset) == 4 and dataset.dtype == np.uint16
    assert dataset.sequence_lengths.dtype == np.int32 and dataset.sequence_lengths.tolist() == TINY_LENGTHS
    assert dataset.sequence_pointers.dtype == np.int64 and dataset.sequence_pointers.tolist() == TINY_POINTERS
    assert dataset.document_indices.dtype == np.int64 and dataset.document_indices.tolist() == TINY_DOC_INDICES
    assert dataset.sequence_modes is None
    assert dataset[3].tolist() == [65535, 0] and dataset[-1].tolist() == [65535, 0]
    assert [s.tolist() for s in dataset[1:3]] == [[10, 11], [12]]
    assert IndexedDataset.exists(tiny) and not IndexedDataset.exists(tiny + "_missing")
    with pytest.raises(IndexError):
        dataset[4]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_random_documents(tmp_path, dtype, mmap):
    rng = np.random.default_rng(0)
    documents = random_documents(rng, 40, high=int(np.iinfo(dtype).max))
    prefix = write_dataset(str(tmp_path / "data"), documents, dtype)
    dataset = IndexedDataset(prefix, mmap=mmap)
    sequences = [s for doc in documents for s in doc]
    assert len(dataset) == len(sequences)
    assert any(len(s) == 0 for s in sequences)
    assert dataset.document_indices.tolist() == np.cumsum([0] + [len(d) for d in documents]).tolist()
    for i, sequence in enumerate(sequences):
        got = dataset[i]
        assert got.dtype == dtype and got.tolist() == sequence
        offset = min(2, len(sequence))
        assert dataset.get(i, offset=offset).tolist() == sequence[offset:]
        assert dataset.get(i, offset=offset, length=0).tolist() == []
        if len(sequence) >= 4:
            assert dataset.get(i, offset=1, length=2).tolist() == sequence[1:3]
    with pytest.raises(ValueError, match="does not fit"):
        dataset.get(0, offset=0, length=len(sequences[0]) + 1)
    reopened = pickle.loads(pickle.dumps(dataset))
    assert [reopened[i].tolist() for i in range(len(reopened))] == sequences


def test_empty_dataset_round_trips(tmp_path):
    prefix = write_dataset(str(tmp_path / "empty"), [], np.int32)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 0 and dataset.document_indices.tolist() == [0]


def test_add_document_splits_into_sequences(tmp_path):
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    builder.add_document([1, 2, 3, 4, 5], lengths=[2, 0, 3])
    builder.add_document([7, 8])
    with pytest.raises(ValueError, match="partition"):
        builder.add_document([1, 2], lengths=[3])
    builder.finalize(get_idx_path(prefix))
    dataset = IndexedDataset(prefix)
    assert [s.tolist() for s in dataset[:]] == [[1, 2], [], [3, 4, 5], [7, 8]]
    assert dataset.document_indices.tolist() == [0, 3, 4]


def test_add_index_merge_equals_single_write(tmp_path):
    rng = np.random.default_rng(1)
    first, second, own = (random_documents(rng, n, high=60000) for n in (15, 20, 3))
    part1 = write_dataset(str(tmp_path / "part1"), first, np.uint16)
    part2 = write_dataset(str(tmp_path / "part2"), second, np.uint16)
    with open(get_bin_path(part2), "ab") as f:  # a trailing whole item is not data and must not be copied
        f.write(b"\x07\x00")
    single = write_dataset(str(tmp_path / "single"), own + first + second, np.uint16)

    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(get_bin_path(merged), dtype=np.uint16)
    for sequences in own:
        builder.add_document(np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]),
                             lengths=[len(s) for s in sequences])
    builder.add_index(part1)
    builder.add_index(part2)
    builder.finalize(get_idx_path(merged))
    assert read_bytes(get_idx_path(merged)) == read_bytes(get_idx_path(single))
    assert read_bytes(get_bin_path(merged)) == read_bytes(get_bin_path(single))


def test_add_index_rejects_dtype_mismatch_and_open_document(tmp_path, tiny):
    builder = IndexedDatasetBuilder(str(tmp_path / "wide.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match="dtype uint16 does not match"):
        builder.add_index(tiny)
    builder = IndexedDatasetBuilder(str(tmp_path / "open.bin"), dtype=np.uint16)
    builder.add_item([1])
    with pytest.raises(ValueError, match="end_document"):
        builder.add_index(tiny)
    with pytest.raises(ValueError, match="end_document"):
        builder.finalize(str(tmp_path / "open.idx"))


def test_bin_is_streamed_before_finalize(tmp_path):
    bin_path = tmp_path / "stream.bin"
    builder = IndexedDatasetBuilder(str(bin_path), dtype=np.int32)
    builder.add_item(np.arange(100_000))
    assert bin_path.stat().st_size >= 4 * 100_000
    builder.end_document()
    builder.finalize(str(tmp_path / "stream.idx"))


def test_optimal_dtype_boundary():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32


@pytest.mark.parametrize("dtype, tokens", [
    (np.uint16, [1, 65536]), (np.uint16, [-1]), (np.int8, [128]), (np.int32, [2**31]),
    (np.uint8, [1.5]),
])
def test_token_that_does_not_fit_raises(tmp_path, dtype, tokens):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=dtype)
    with pytest.raises(ValueError, match="fit|integers"):
        builder.add_item(tokens)
    builder.add_item([0])  # the failed item left nothing behind
    builder.end_document()
    builder.finalize(str(tmp_path / "x.idx"))
    assert IndexedDataset(str(tmp_path / "x")).sequence_lengths.tolist() == [1]


def test_unsupported_builder_dtype_raises(tmp_path):
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint32)


def corrupted_copy(tiny, tmp_path, edit_idx=None, edit_bin=None):
    """Copy the tiny dataset to a new prefix, then apply byte edits (bytearray -> bytes)."""
    prefix = str(tmp_path / "corrupt")
    for path_of, edit in ((get_idx_path, edit_idx), (get_bin_path, edit_bin)):
        data = bytearray(read_bytes(path_of(tiny)))
        with open(path_of(prefix), "wb") as f:
            f.write(edit(data) if edit else data)
    return prefix


def patch(at, packed):
    def edit(data):
        data[at:at + len(packed)] = packed
        return data
    return edit


CORRUPTIONS = {
    "bad magic": (patch(0, b"XMIDIDX"), None, "idx", "not a Megatron indexed dataset"),
    "version 2": (patch(9, struct.pack("<Q", 2)), None, "idx", "unsupported index version 2"),
    "dtype code 9": (patch(17, b"\x09"), None, "idx", "unknown dtype code 9"),
    "dtype code 0": (patch(17, b"\x00"), None, "idx", "unknown dtype code 0"),
    "idx truncated in arrays": (lambda d: d[:-8], None, "idx", "truncated"),
    "idx truncated in header": (lambda d: d[:20], None, "idx", "truncated"),
    "idx trailing junk": (lambda d: d + b"\x00\x00\x00", None, "idx", "unexpected bytes"),
    "doc indices start": (patch(DOCS_AT, struct.pack("<q", 1)), None, "idx", "starts at 1"),
    "doc indices end": (patch(DOCS_AT + 24, struct.pack("<q", 3)), None, "idx", "ends at 3"),
    "doc indices decrease": (patch(DOCS_AT + 8, struct.pack("<q", 3) + struct.pack("<q", 1)),
                             None, "idx", "decreases"),
    "pointer off": (patch(POINTERS_AT + 16, struct.pack("<q", 8)), None, "idx", "pointers inconsistent"),
    "negative length": (patch(LENGTHS_AT + 4, struct.pack("<i", -2)), None, "idx", "negative length"),
    "bin truncated": (None, lambda d: d[:-2], "bin", "truncated"),
    "bin partial item": (None, lambda d: d + b"\x00", "bin", "not a multiple"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_is_rejected_naming_the_file(tiny, tmp_path, case):
    edit_idx, edit_bin, which, problem = CORRUPTIONS[case]
    prefix = corrupted_copy(tiny, tmp_path, edit_idx, edit_bin)
    path = get_idx_path(prefix) if which == "idx" else get_bin_path(prefix)
    with pytest.raises(ValueError, match=re.escape(path) + ".*" + re.escape(problem)):
        IndexedDataset(prefix)


@pytest.mark.parametrize("missing", [get_idx_path, get_bin_path])
def test_missing_file_raises_file_not_found(tiny, tmp_path, missing):
    prefix = corrupted_copy(tiny, tmp_path)
    IndexedDataset(prefix)  # the untouched copy loads
    os.remove(missing(prefix))
    with pytest.raises(FileNotFoundError, match=re.escape(missing(prefix))):
        IndexedDataset(prefix)


def test_tolerated_extras_load(tiny, tmp_path):
    """A whole trailing item in .bin and a sequence_modes block in .idx are both legal."""
    modes = bytes([0, 1, 0, 1])
    prefix = corrupted_copy(tiny, tmp_path, lambda d: d + modes, lambda d: d + b"\x05\x00")
    dataset = IndexedDataset(prefix)
    assert dataset.sequence_modes.dtype == np.int8 and dataset.sequence_modes.tolist() == [0, 1, 0, 1]
    assert dataset[3].tolist() == [65535, 0]


def test_copy_of_tiny_is_byte_identical(tiny, tmp_path):
    """Guards the corruption tests: with no edit, the copy must equal the original."""
    prefix = corrupted_copy(tiny, tmp_path)
    assert read_bytes(get_idx_path(prefix)) == read_bytes(get_idx_path(tiny))
    assert read_bytes(get_bin_path(prefix)) == read_bytes(get_bin_path(tiny))


def test_module_does_not_import_torch():
    code = ("import sys, megatron.core.datasets.indexed_dataset; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
