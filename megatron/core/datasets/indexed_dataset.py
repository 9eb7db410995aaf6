"""Megatron's `.bin`/`.idx` tokenized-corpus format: a memory-mapped reader and a streaming writer.

Byte compatibility with Megatron-LM lets us reuse corpora tokenized by its tools (and lets
them read ours). The layout is specified in `reference/frameworks.md` section 2.1:

    .bin  raw little-endian token ids of every sequence, concatenated, no header
    .idx  magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code
          | uint64 S (sequences) | uint64 D (document-index entries)
          | int32 lengths[S] | int64 byte pointers[S] | int64 document_indices[D]
          | optional int8 sequence_modes[S] (multimodal corpora only)

This module imports numpy only: the preprocessing tool imports it and must start without
torch. Every check on load raises before any data is returned, so a corrupt or truncated
corpus fails at start-up with one message naming the file, not hours later as garbage tokens:
an InputError (`check_indexed_dataset` is the cheap subset run when the flags are parsed).
"""

import os
import struct
from array import array

import numpy as np

from megatron.core.datasets.pair_publish import readable_pair
from megatron.core.errors import InputError

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Magic, version, dtype code, sequence count, document-index length; '<' means no padding.
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34
# Validation walks the index in chunks so loading a billion-sequence corpus stays
# zero-copy instead of materialising cumulative sums the size of the whole index.
_CHECK_CHUNK = 1 << 20
_COPY_CHUNK = 16 << 20
_INT32_MAX = np.iinfo(np.int32).max


def optimal_dtype(vocab_size: int) -> type:
    """Smallest dtype Megatron would pick for `vocab_size` (uint16 halves the corpus on disk).

    The 65500 threshold (not 65536) is Megatron's rule; keeping it makes our preprocessor
    produce byte-identical files to Megatron's for the same tokenizer.
    """
    return np.uint16 if vocab_size < 65500 else np.int32


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


ANSWER_SUFFIX = ".answer"
ANSWER_DTYPE = np.uint8


def get_answer_prefix(path_prefix: str) -> str:
    """Prefix of the answer-mask pair beside an SFT corpus (`tools/preprocess_data.py --chat`):
    one uint8 per token, 1 where the token is an answer (maskable, a target), 0 in the prompt;
    the same sequence lengths and document index as the token pair."""
    return path_prefix + ANSWER_SUFFIX


def dtype_code(dtype) -> int:
    """The `.idx` code of `dtype`; ValueError for dtypes the format cannot describe."""
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
    raise ValueError(f"dtype {np.dtype(dtype).name} cannot be stored in an indexed dataset; use one of {names}")


def _corrupt(path: str, problem: str) -> InputError:
    # Bad bytes on disk are the user's input, not our bug; the only cure is a fresh pair.
    return InputError(f"{path}: {problem}; the pair is damaged or incomplete: "
                      "re-run tools/preprocess_data.py to rebuild it")


def _little_endian(dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _read_header(idx_path: str) -> tuple[int, int, int, bool]:
    """Parse and check the fixed header; returns (dtype code, S, D, has sequence_modes)."""
    file_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if head[:len(MAGIC)] != MAGIC[:len(head)]:
        raise _corrupt(idx_path, f"not a Megatron indexed dataset (magic bytes are "
                         f"{head[:len(MAGIC)]!r}, expected {MAGIC!r})")
    if len(head) < HEADER_SIZE:
        raise _corrupt(idx_path, f"truncated: {file_size} bytes is shorter than the "
                         f"{HEADER_SIZE}-byte header")
    _, version, code, num_sequences, num_doc_entries = _HEADER.unpack(head)
    if version != VERSION:
        raise _corrupt(idx_path, f"unsupported index version {version} (only {VERSION} is known)")
    if code not in DTYPE_CODES:
        raise _corrupt(idx_path, f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    body = HEADER_SIZE + 12 * num_sequences + 8 * num_doc_entries
    if file_size < body:
        raise _corrupt(idx_path, f"truncated: the header declares {num_sequences} sequences and "
                         f"{num_doc_entries} document indices ({body} bytes) but the file has {file_size}")
    if file_size not in (body, body + num_sequences):
        raise _corrupt(idx_path, f"{file_size - body} unexpected bytes after the document indices "
                         f"(only an optional int8 sequence_modes block of {num_sequences} bytes may follow)")
    has_modes = num_sequences > 0 and file_size == body + num_sequences
    return code, num_sequences, num_doc_entries, has_modes


def _check_lengths_and_pointers(idx_path: str, lengths: np.ndarray, pointers: np.ndarray,
                                itemsize: int) -> int:
    """Pointers must be the running sum of length * itemsize; returns the data size in bytes.

    A pointer that disagrees with the lengths means the reader would silently return tokens
    of a neighbouring sequence, so it is rejected rather than trusted.
    """
    next_pointer = 0
    for start in range(0, len(lengths), _CHECK_CHUNK):
        chunk_lengths = lengths[start:start + _CHECK_CHUNK].astype(np.int64)
        negative = np.flatnonzero(chunk_lengths < 0)
        if negative.size:
            i = start + int(negative[0])
            raise _corrupt(idx_path, f"negative length {int(lengths[i])} for sequence {i}")
        sizes = chunk_lengths * itemsize
        expected = next_pointer + np.cumsum(sizes) - sizes
        wrong = np.flatnonzero(pointers[start:start + _CHECK_CHUNK] != expected)
        if wrong.size:
            i = start + int(wrong[0])
            raise _corrupt(idx_path, f"pointers inconsistent with lengths: sequence {i} points at "
                             f"byte {int(pointers[i])}, expected {int(expected[wrong[0]])}")
        next_pointer = int(expected[-1] + sizes[-1])
    return next_pointer


def _check_document_indices(idx_path: str, document_indices: np.ndarray, num_sequences: int) -> None:
    """Document boundaries must run from 0 to S without going backwards."""
    if len(document_indices) == 0:
        raise _corrupt(idx_path, f"document_indices is empty (it must start with 0 and end with {num_sequences})")
    if document_indices[0] != 0:
        raise _corrupt(idx_path, f"document_indices starts at {int(document_indices[0])}, expected 0")
    if document_indices[-1] != num_sequences:
        raise _corrupt(idx_path, f"document_indices ends at {int(document_indices[-1])}, "
                         f"expected the sequence count {num_sequences}")
    # Chunks overlap by one entry so a decrease across a chunk boundary is still seen.
    for start in range(0, len(document_indices) - 1, _CHECK_CHUNK):
        steps = np.diff(document_indices[start:start + _CHECK_CHUNK + 1])
        backwards = np.flatnonzero(steps < 0)
        if backwards.size:
            i = start + int(backwards[0]) + 1
            raise _corrupt(idx_path, f"document_indices decreases at entry {i} "
                             f"({int(document_indices[i - 1])} -> {int(document_indices[i])})")


def _check_bin_size(bin_path: str, data_bytes: int, itemsize: int) -> None:
    """The .bin must hold every indexed byte; extra whole items are tolerated, partial ones not."""
    size = os.path.getsize(bin_path)
    if size < data_bytes:
        raise _corrupt(bin_path, f"truncated: the index needs {data_bytes} bytes but the file has {size}")
    if (size - data_bytes) % itemsize:
        raise _corrupt(bin_path, f"size {size} exceeds the indexed {data_bytes} bytes by "
                         f"{size - data_bytes}, not a multiple of the {itemsize}-byte item size")


def _readable(path_prefix: str) -> tuple[str, str]:
    """(idx path, bin path) to read: the earlier pair while a publish of its corpus is uncommitted
    (pair_publish.py; an answer pair follows its token pair)."""
    token_prefix = path_prefix[:-len(ANSWER_SUFFIX)] if path_prefix.endswith(ANSWER_SUFFIX) else path_prefix
    return readable_pair(path_prefix, token_prefix)


def _require_pair(path_prefix: str) -> tuple[str, str]:
    """(idx path, bin path), or FileNotFoundError naming the half that is missing."""
    idx_path, bin_path = _readable(path_prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: file not found (an indexed dataset needs both "
                                    f"{os.path.basename(bin_path)} and {os.path.basename(idx_path)})")
    return idx_path, bin_path


def _index_arrays(idx_map: np.ndarray, num_sequences: int, num_doc_entries: int, has_modes: bool):
    """Zero-copy views (lengths, pointers, document_indices, modes or None) of a mapped .idx."""
    offset = HEADER_SIZE
    lengths = np.frombuffer(idx_map, "<i4", num_sequences, offset)
    offset += 4 * num_sequences
    pointers = np.frombuffer(idx_map, "<i8", num_sequences, offset)
    offset += 8 * num_sequences
    document_indices = np.frombuffer(idx_map, "<i8", num_doc_entries, offset)
    offset += 8 * num_doc_entries
    modes = np.frombuffer(idx_map, "<i1", num_sequences, offset) if has_modes else None
    return lengths, pointers, document_indices, modes


def check_indexed_dataset(path_prefix: str) -> int:
    """Cheap start-up check of a `.bin`/`.idx` pair; returns its number of documents.

    Runs at argument-parse time, before any model is built, so it reads only the header and the
    first and last index entries (memory-mapped: no array and no token is read), which keeps a
    terabyte corpus instant to check. Everything a damaged pair usually shows is caught here:
    bad magic, version or dtype code, a truncated .idx, a last sequence ending past the end of
    the .bin. IndexedDataset still checks every pointer when the data is loaded.
    Raises InputError naming the file (FileNotFoundError when a half is missing).
    """
    idx_path, bin_path = _require_pair(path_prefix)
    code, num_sequences, num_doc_entries, has_modes = _read_header(idx_path)
    itemsize = np.dtype(DTYPE_CODES[code]).itemsize
    idx_map = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths, pointers, document_indices, _ = _index_arrays(idx_map, num_sequences, num_doc_entries, has_modes)
    _check_document_indices(idx_path, document_indices[[0, -1]] if num_doc_entries else document_indices,
                            num_sequences)
    data_bytes = 0
    if num_sequences:
        first, last, length = int(pointers[0]), int(pointers[-1]), int(lengths[-1])
        if first != 0 or last < 0 or length < 0:
            raise _corrupt(idx_path, f"sequence index out of range: first pointer {first} (expected 0), "
                                     f"last pointer {last}, last length {length}")
        data_bytes = last + length * itemsize
    _check_bin_size(bin_path, data_bytes, itemsize)
    return num_doc_entries - 1


class IndexedDataset:
    """Read-only view of a Megatron `.bin`/`.idx` pair; sequences come back as numpy arrays.

    The index arrays are zero-copy views of the memory-mapped `.idx`. With `mmap=True` the
    `.bin` is memory-mapped too (pages shared between DataLoader workers); `mmap=False` reads
    each request through a file handle instead, for filesystems where mmap is slow or banned.
    """

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = path_prefix
        self.mmap = mmap
        idx_path, bin_path = _require_pair(path_prefix)
        code, num_sequences, num_doc_entries, has_modes = _read_header(idx_path)
        self.dtype = DTYPE_CODES[code]
        self._item = _little_endian(self.dtype)

        self._idx_map = np.memmap(idx_path, dtype=np.uint8, mode="r")
        (self.sequence_lengths, self.sequence_pointers, self.document_indices,
         self.sequence_modes) = _index_arrays(self._idx_map, num_sequences, num_doc_entries, has_modes)

        _check_document_indices(idx_path, self.document_indices, num_sequences)
        self._data_bytes = _check_lengths_and_pointers(
            idx_path, self.sequence_lengths, self.sequence_pointers, self._item.itemsize)
        _check_bin_size(bin_path, self._data_bytes, self._item.itemsize)

        self._bin_path = bin_path
        num_items = self._data_bytes // self._item.itemsize
        if not mmap:
            self._tokens = None
        elif num_items == 0:  # numpy cannot memory-map zero bytes
            self._tokens = np.empty(0, dtype=self._item)
        else:
            self._tokens = np.memmap(bin_path, dtype=self._item, mode="r", shape=(num_items,))

    def __getstate__(self):
        # Re-open instead of pickling the memory maps (which would copy the whole corpus
        # into every spawned DataLoader worker).
        return {"path_prefix": self.path_prefix, "mmap": self.mmap}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"], state["mmap"])

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx):
        """One sequence for an integer, a list of sequences for a slice (Megatron's behaviour)."""
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (to its end when length is None).

        GPTDataset stitches samples from partial sequences, so reading a window must not
        touch the rest of a possibly very long document.
        """
        num_sequences = len(self)
        if not -num_sequences <= idx < num_sequences:
            raise IndexError(f"sequence {idx} out of range for {num_sequences} sequences in {self.path_prefix}")
        idx = int(idx) % num_sequences
        sequence_length = int(self.sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise ValueError(f"window offset={offset} length={length} does not fit sequence {idx} "
                             f"of length {sequence_length} in {self.path_prefix}")
        first = int(self.sequence_pointers[idx]) // self._item.itemsize + offset
        if self._tokens is not None:
            return self._tokens[first:first + length]
        with open(self._bin_path, "rb") as f:
            f.seek(first * self._item.itemsize)
            return np.fromfile(f, dtype=self._item, count=length)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Both halves present; lets callers give a clear error before trying to load."""
        return all(os.path.isfile(path) for path in _readable(path_prefix))


VOCABULARY_FIX = ("tokenize the data with this run's tokenizer (tools/preprocess_data.py), or train with the "
                  "tokenizer it was made with (--tokenizer-type, --tokenizer-model, --vocab-size)")
LEADING_TOKENS = 1 << 16
"""Tokens of each corpus read when the flags are checked: a wrong tokenizer shows in any of them."""


def out_of_vocabulary(ids: np.ndarray, vocab_size: int | None) -> int | None:
    """The largest id of `ids` at or above `vocab_size` (or a negative one), None when all fit.

    One min/max on the host per piece read: cheap next to the read itself (checking a whole corpus
    at start-up is not), and found before an embedding lookup would meet it (a device-side assert
    on CUDA; an id among the padding rows reads a row no loss can predict).
    """
    if vocab_size is None or not len(ids):
        return None
    high = int(ids.max())
    if high >= vocab_size:
        return high
    low = int(ids.min()) if np.dtype(ids.dtype).kind == "i" else 0
    return low if low < 0 else None


def vocabulary_error(where: str, token_id: int, vocab_size: int) -> InputError:
    return InputError(f"{where}: token id {token_id} is outside this run's vocabulary of {vocab_size} ids "
                      f"([0, {vocab_size})); {VOCABULARY_FIX}")


def check_leading_tokens(path_prefix: str, vocab_size: int) -> None:
    """The first LEADING_TOKENS tokens of the pair fit the vocabulary (InputError naming the .bin if not):
    a corpus made with another tokenizer stops the run when its flags are checked, on every rank alike."""
    idx_path, bin_path = _require_pair(path_prefix)
    item = _little_endian(DTYPE_CODES[_read_header(idx_path)[0]])
    count = min(LEADING_TOKENS, os.path.getsize(bin_path) // item.itemsize)
    bad = out_of_vocabulary(np.fromfile(bin_path, dtype=item, count=count), vocab_size)
    if bad is not None:
        raise vocabulary_error(f"{bin_path} (among its first {count} tokens)", bad, vocab_size)


def _checked_tokens(tokens, dtype: np.dtype) -> np.ndarray:
    """`tokens` as a little-endian `dtype` array, refusing values that would wrap or truncate.

    numpy's astype silently wraps 70000 to 4464 in uint16; a corpus written that way trains
    on wrong tokens with no visible error, so the range is checked before casting.
    """
    values = np.asarray(tokens)
    if values.ndim != 1:
        raise ValueError(f"a sequence must be a 1-D array of token ids, got shape {values.shape}")
    if values.size and values.dtype.kind not in "biuf":
        raise ValueError(f"token ids must be numbers, got dtype {values.dtype}")
    if values.size and dtype.kind in "iu":
        if values.dtype.kind == "f" and not np.all(np.isfinite(values) & (values == np.trunc(values))):
            raise ValueError(f"token ids must be integers to store as {dtype.name}")
        info = np.iinfo(dtype)
        low, high = int(values.min()), int(values.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise ValueError(f"token id {bad} does not fit {dtype.name} [{info.min}, {info.max}]; "
                             f"build with a wider dtype (see optimal_dtype)")
    stored = values.astype(_little_endian(dtype))
    if values.size and dtype.kind == "f" and np.any(np.isinf(stored) & np.isfinite(values)):
        raise ValueError(f"a value overflows {dtype.name}")
    return stored


class IndexedDatasetBuilder:
    """Streams sequences into a `.bin` and writes the matching `.idx` on `finalize`.

    Tokens go to disk as they arrive; only the per-sequence lengths and document boundaries
    (12 bytes a sequence) stay in memory, so corpora far larger than RAM can be written.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self._code = dtype_code(dtype)
        self.dtype = DTYPE_CODES[self._code]
        self._item = _little_endian(self.dtype)
        self.bin_path = bin_path
        self._bin = open(bin_path, "wb")
        self._lengths = array("q")
        self._document_indices = array("q", [0])

    def _require_open(self) -> None:
        if self._bin.closed:
            raise RuntimeError(f"builder for {self.bin_path} is already finalized")

    def add_item(self, tokens) -> None:
        """Append one sequence; it belongs to the document closed by the next end_document()."""
        self._require_open()
        stored = _checked_tokens(tokens, np.dtype(self.dtype))
        if len(stored) > _INT32_MAX:
            raise ValueError(f"sequence of {len(stored)} tokens exceeds the format's int32 length limit")
        self._bin.write(stored.tobytes())
        self._lengths.append(len(stored))

    def end_document(self) -> None:
        """Close the current document: every sequence since the previous boundary belongs to it."""
        self._require_open()
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """Append a document given as flat tokens split into sequences of `lengths` (one if None)."""
        self._require_open()
        flat = np.asarray(tokens)
        if lengths is None:
            lengths = [len(flat)]
        if any(n < 0 for n in lengths) or sum(lengths) != len(flat):
            raise ValueError(f"sequence lengths {list(lengths)} do not partition {len(flat)} tokens")
        start = 0
        for n in lengths:
            self.add_item(flat[start:start + n])
            start += n
        self.end_document()

    def _require_closed_document(self, action: str) -> None:
        if self._document_indices[-1] != len(self._lengths):
            raise ValueError(f"{self.bin_path}: {len(self._lengths) - self._document_indices[-1]} "
                             f"sequences added after the last end_document(); call it before {action}")

    def add_index(self, path_prefix: str) -> None:
        """Append every document of an existing dataset (how preprocessing merges partitions).

        The source is opened through IndexedDataset so a corrupt partition is rejected
        instead of being copied into the merged corpus.
        """
        self._require_open()
        self._require_closed_document("add_index()")
        source = IndexedDataset(path_prefix)
        if np.dtype(source.dtype) != np.dtype(self.dtype):
            raise ValueError(f"{get_idx_path(path_prefix)}: dtype {np.dtype(source.dtype).name} does not "
                             f"match the builder's {np.dtype(self.dtype).name}")
        if source.sequence_modes is not None:
            raise ValueError(f"{get_idx_path(path_prefix)}: has sequence_modes (multimodal); "
                             f"merging those is not supported")
        already = len(self._lengths)
        self._lengths.frombytes(source.sequence_lengths.astype(np.int64).tobytes())
        self._document_indices.frombytes((source.document_indices[1:] + already).astype(np.int64).tobytes())
        # Copy only the indexed bytes: any trailing whole items in the source are not data.
        remaining = source._data_bytes
        with open(get_bin_path(path_prefix), "rb") as src:
            while remaining:
                block = src.read(min(remaining, _COPY_CHUNK))
                self._bin.write(block)
                remaining -= len(block)

    def finalize(self, idx_path: str) -> None:
        """Close the .bin and write the .idx; the dataset is readable only after this."""
        self._require_open()
        self._require_closed_document("finalize()")
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64)
        sizes = lengths * self._item.itemsize
        pointers = np.cumsum(sizes) - sizes
        document_indices = np.frombuffer(self._document_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(document_indices)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(document_indices.astype("<i8").tobytes())
