"""Bad data inputs fail with one line naming the flag or file, never a traceback or a hang,
and never damage a good .bin/.idx pair written earlier.

tools/preprocess_data.py runs as a subprocess (the real CLI). Worker deaths are simulated by
a small wrapper script that replaces one of the tool's functions before calling its main():
the replacement SIGKILLs a real worker process, so no test hook lives in the tool itself.
Training-data checks go through pretrain_difflm.py's CLI for two cases and call
check_prefixes_exist (what the CLI's argument parsing calls) directly for the rest.
"""

import json
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.dataset_builder import check_prefixes_exist
from megatron.core.datasets.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, check_indexed_dataset,
                                                    get_bin_path, get_idx_path)
from megatron.core.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "preprocess_data.py"
SPM = ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model"
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
TIMEOUT_S = 60  # a hang fails the test instead of blocking the suite

# .idx header offsets (reference/frameworks.md 2.1): magic 9 bytes, version u64, dtype u8, S u64, D u64.
VERSION_AT, DTYPE_AT, HEADER = 9, 17, 34


def write_jsonl(path, count, start=0):
    path.write_text("".join(json.dumps({"text": " ".join(str(start + i + j) for j in range(5))}) + "\n"
                            for i in range(count)))
    return path


def snapshot(prefix):
    return tuple(Path(path_of(prefix)).read_bytes() for path_of in (get_bin_path, get_idx_path))


@pytest.fixture(scope="module")
def made_once(tmp_path_factory):
    folder = tmp_path_factory.mktemp("made_once")
    source = write_jsonl(folder / "good.jsonl", 20)
    result = run_tool(["--input", str(source), "--output-prefix", str(folder / "out"), "--workers", "1", *NULL])
    assert result.returncode == 0, result.stderr
    return folder


@pytest.fixture
def good(made_once, tmp_path):
    """A good pair written by the tool from 20 documents, copied here (one tool run per module):
    (input, pair prefix, the --output-prefix that wrote it, its bytes)."""
    for name in ("good.jsonl", "out_text_document.bin", "out_text_document.idx"):
        shutil.copy(made_once / name, tmp_path / name)
    prefix = str(tmp_path / "out_text_document")
    return tmp_path / "good.jsonl", prefix, str(tmp_path / "out"), snapshot(prefix)


def run_tool(argv, patch=None, tmp_path=None):
    """The tool's CLI; with `patch`, a wrapper that runs that code on the tool's module first."""
    command = [sys.executable, str(TOOL)]
    if patch is not None:
        wrapper = tmp_path / "wrapper.py"
        wrapper.write_text(f"import errno, os, signal, sys\nsys.path.insert(0, {str(TOOL.parent)!r})\n"
                           f"import preprocess_data as tool\n{textwrap.dedent(patch)}\ntool.main(sys.argv[1:])\n")
        command = [sys.executable, str(wrapper)]
    return subprocess.run(command + argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_one_line_error(result, *names):
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    for name in names:
        assert name in errors[0], errors[0]


def assert_untouched(prefix, before):
    """Same bytes, still loads, and the failed run left no temporary or partition files."""
    assert snapshot(prefix) == before
    assert len(IndexedDataset(prefix)) == 20
    assert check_indexed_dataset(prefix) == 20
    assert not list(Path(prefix).parent.glob("*.tmp-*")), list(Path(prefix).parent.iterdir())


# ---- tools/preprocess_data.py ----------------------------------------------------------------

def test_non_utf8_input_leaves_the_earlier_pair_untouched(good, tmp_path):
    source, prefix, out, before = good
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(source.read_bytes() + b'{"text": "caf\xe9"}\n')  # latin-1, line 21
    for flags in (["--workers", "1"], ["--workers", "2", "--partitions", "2"]):
        result = run_tool(["--input", str(bad), "--output-prefix", out, *flags, *NULL])
        assert_one_line_error(result, f"--input {bad}:21", "0xe9", "UTF-8")
        assert_untouched(prefix, before)


def test_zero_documents_is_an_error_and_writes_nothing(good, tmp_path):
    _, prefix, out, before = good
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text(json.dumps({"title": "x"}) + "\n")
    for source, flags in ((empty, []), (no_text, ["--partitions", "2"])):
        result = run_tool(["--input", str(source), "--output-prefix", str(tmp_path / "new"), "--workers", "1",
                           *flags, *NULL])
        assert_one_line_error(result, f"--input {source}", "no documents", "--json-keys")
        assert not list(tmp_path.glob("new*")), "no output pair appears"
    result = run_tool(["--input", str(empty), "--output-prefix", out, "--workers", "1", *NULL])
    assert_one_line_error(result, "no documents")
    assert_untouched(prefix, before)


def test_text_the_tokenizer_rejects(good, tmp_path):
    _, prefix, out, before = good
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"text": "not integer ids"}) + "\n")  # the NullTokenizer reads ids only
    result = run_tool(["--input", str(words), "--output-prefix", out, "--workers", "1", "--strict", *NULL])
    assert_one_line_error(result, f"{words}:1: the tokenizer rejected field 'text'", "--strict")
    assert_untouched(prefix, before)


@pytest.mark.parametrize("flags,name", [
    (["--tokenizer-model", "MISSING"], "missing.model"),
    ([], "--tokenizer-model is required"),
])
def test_missing_tokenizer_model(good, tmp_path, flags, name):
    source, prefix, out, before = good
    flags = [str(tmp_path / "missing.model") if f == "MISSING" else f for f in flags]
    result = run_tool(["--input", str(source), "--output-prefix", out, "--tokenizer-type",
                       "SentencePieceTokenizer", *flags])
    assert result.returncode == 2
    assert_one_line_error(result, name)
    assert_untouched(prefix, before)


@pytest.mark.parametrize("flags,name", [
    (["--input", "MISSING_INPUT"], "missing.jsonl: file not found"),
    (["--log-interval", "0"], "--log-interval 0"),
    (["--workers", "0"], "--workers 0"),
])
def test_bad_flags_are_one_line_exit_2(good, tmp_path, flags, name):
    source, prefix, out, before = good
    argv = ["--input", str(source), "--output-prefix", out, *NULL, *flags]
    argv = [str(tmp_path / "missing.jsonl") if a == "MISSING_INPUT" else a for a in argv]
    result = run_tool(argv)
    assert result.returncode == 2
    assert_one_line_error(result, name)
    assert_untouched(prefix, before)


def test_broken_gzip_input(good, tmp_path):
    source, prefix, out, before = good
    broken = tmp_path / "cut.jsonl.gz"
    shutil.copy(source, tmp_path / "whole.jsonl")
    subprocess.run(["gzip", "-f", str(tmp_path / "whole.jsonl")], check=True)
    broken.write_bytes((tmp_path / "whole.jsonl.gz").read_bytes()[:40])
    result = run_tool(["--input", str(broken), "--output-prefix", out, "--workers", "1", *NULL])
    assert_one_line_error(result, f"--input {broken}", "gzip")
    assert_untouched(prefix, before)


# Each replaces a function of the tool so that one real process dies by SIGKILL mid-run.
KILL_PARTITION = """
    real = tool.tokenize_range
    def tokenize_range(args, lines, *rest, **kwargs):
        if lines[0] > 1:  # the second partition's process
            os.kill(os.getpid(), signal.SIGKILL)
        return real(args, lines, *rest, **kwargs)
    tool.tokenize_range = tokenize_range
"""
KILL_TOKENIZER_WORKER = """
    real = tool.encode_batch
    def encode_batch(items):
        if items[-1][0] > 10:  # a worker given the second half of the input
            os.kill(os.getpid(), signal.SIGKILL)
        return real(items)
    tool.encode_batch = encode_batch
"""
# The partition process dies while its own tokenizer workers live on (as under the OOM killer):
# they would wait for tasks forever, holding the tool's stderr open, if they were not ended.
KILL_PARTITION_UNDER_ITS_WORKERS = """
    real = tool.encode_batch
    def encode_batch(items):
        if items[-1][0] > 10:
            os.kill(os.getppid(), signal.SIGKILL)
        return real(items)
    tool.encode_batch = encode_batch
"""
DISK_FULL = """
    def add_item(self, tokens):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.bin_path)
    tool.IndexedDatasetBuilder.add_item = add_item
"""


@pytest.mark.parametrize("patch,flags,message", [
    (KILL_PARTITION, ["--partitions", "2", "--workers", "2"], "partition 1 died (killed by signal 9"),
    (KILL_TOKENIZER_WORKER, ["--workers", "2"], "tokenizer worker process died"),
    (KILL_TOKENIZER_WORKER, ["--partitions", "2", "--workers", "4"], "tokenizer worker process died"),
    (KILL_PARTITION_UNDER_ITS_WORKERS, ["--partitions", "2", "--workers", "4"], "partition 1 died"),
    (DISK_FULL, ["--partitions", "2", "--workers", "2"], "No space left on device"),
], ids=["partition-killed", "worker-killed", "worker-in-partition-killed", "partition-killed-under-workers",
        "disk-full"])
def test_dead_worker_ends_the_run_without_a_hang(good, tmp_path, patch, flags, message):
    source, prefix, out, before = good
    result = run_tool(["--input", str(source), "--output-prefix", out, *flags, *NULL], patch, tmp_path)
    assert_one_line_error(result, message)
    assert_untouched(prefix, before)


def test_the_wrapper_runs_the_real_tool(good, tmp_path):
    """Guards the tests above: with a no-op patch the wrapper writes the same pair."""
    source, prefix, _, before = good
    result = run_tool(["--input", str(source), "--output-prefix", str(tmp_path / "again"), "--workers", "2",
                       "--partitions", "2", *NULL], "pass", tmp_path)
    assert result.returncode == 0, result.stderr
    assert snapshot(str(tmp_path / "again_text_document")) == before


# ---- training data: check_prefixes_exist, run when pretrain_difflm.py parses its flags ------

def patch_at(at, packed):
    def edit(data):
        data[at:at + len(packed)] = packed
        return data
    return edit


def last_pointer_at(data):
    num_sequences = struct.unpack_from("<Q", data, 18)[0]
    return HEADER + 4 * num_sequences + 8 * (num_sequences - 1)


def last_length_at(data):
    return HEADER + 4 * (struct.unpack_from("<Q", data, 18)[0] - 1)


CORRUPTIONS = {
    "bin truncated": (None, lambda d: d[:-3], ".bin", "truncated"),
    "bad magic": (patch_at(0, b"NOTMMIDX"), None, ".idx", "not a Megatron indexed dataset"),
    "bad version": (patch_at(VERSION_AT, struct.pack("<Q", 7)), None, ".idx", "unsupported index version 7"),
    "unknown dtype code": (patch_at(DTYPE_AT, b"\x0c"), None, ".idx", "unknown dtype code 12"),
    # int32 (code 4) for uint16 data: the last sequence then ends past the end of the .bin.
    "wrong dtype code": (patch_at(DTYPE_AT, b"\x04"), None, ".bin", "the index needs"),
    "idx truncated": (lambda d: d[:-5], None, ".idx", "truncated"),
    "idx header truncated": (lambda d: d[:12], None, ".idx", "truncated"),
    "last pointer past the bin": (lambda d: patch_at(last_pointer_at(d), struct.pack("<q", 1 << 20))(d),
                                  None, ".bin", "the index needs"),
    "last size past the bin": (lambda d: patch_at(last_length_at(d), struct.pack("<i", 1000))(d),
                               None, ".bin", "the index needs"),
    "negative pointer": (lambda d: patch_at(last_pointer_at(d), struct.pack("<q", -8))(d),
                         None, ".idx", "out of range"),
}


def corrupted(good_prefix, tmp_path, edit_idx, edit_bin):
    prefix = str(tmp_path / "bad_text_document")
    for path_of, edit in ((get_idx_path, edit_idx), (get_bin_path, edit_bin)):
        data = bytearray(Path(path_of(good_prefix)).read_bytes())
        Path(path_of(prefix)).write_bytes(bytes(edit(data) if edit else data))
    return prefix


def empty_pair(tmp_path):
    prefix = str(tmp_path / "empty_text_document")
    IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16).finalize(get_idx_path(prefix))
    return prefix


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_damaged_pair_is_rejected_when_flags_are_checked(good, tmp_path, case):
    _, prefix, _, before = good
    edit_idx, edit_bin, suffix, problem = CORRUPTIONS[case]
    bad = corrupted(prefix, tmp_path, edit_idx, edit_bin)
    with pytest.raises(InputError, match=re.escape(f"--data-path: {bad}{suffix}: ") + ".*"
                       + re.escape(problem) + ".*re-run tools/preprocess_data.py"):
        check_prefixes_exist([prefix, bad], "--data-path")
    with pytest.raises(ValueError, match=re.escape(bad)):
        IndexedDataset(bad)  # the full load agrees
    assert_untouched(prefix, before)


def test_zero_document_pair_is_rejected(good, tmp_path):
    _, prefix, _, before = good
    empty = empty_pair(tmp_path)
    assert len(IndexedDataset(empty)) == 0, "a valid file, but not training data"
    with pytest.raises(InputError, match=re.escape(f"--train-data-path: {empty}.bin / {empty}.idx holds no documents")):
        check_prefixes_exist([prefix, empty], "--train-data-path")
    assert_untouched(prefix, before)


def test_good_pair_passes_the_check(good):
    _, prefix, _, before = good
    check_prefixes_exist([prefix], "--data-path")
    assert_untouched(prefix, before)


TINY_CLI = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
            "--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--add-mask-token",
            "--micro-batch-size", "1",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


@pytest.mark.parametrize("case", ["bin truncated", "zero documents"])  # each run imports torch: ~5 s
def test_pretrain_cli_rejects_a_bad_prefix_at_parse_time(good, tmp_path, case):
    _, prefix, _, before = good
    if case == "zero documents":
        bad, names = empty_pair(tmp_path), ["holds no documents"]
    else:
        edit_idx, edit_bin, suffix, problem = CORRUPTIONS[case]
        bad = corrupted(prefix, tmp_path, edit_idx, edit_bin)
        names = [f"{bad}{suffix}", problem, "re-run tools/preprocess_data.py"]
    result = subprocess.run([sys.executable, "pretrain_difflm.py", "--data-path", prefix, bad, *TINY_CLI],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert_one_line_error(result, "--data-path", *names)
    assert "iteration" not in result.stdout, "stopped before training"
    assert_untouched(prefix, before)


# ---- token ids outside the vocabulary (NullTokenizer --vocab-size 64: ids 0..63; padded to 128 rows) -----

def pair_of(prefix, sequences, dtype=np.uint16):
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=dtype)
    for tokens in sequences:
        builder.add_document(np.asarray(tokens))
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


def run_pretrain(*argv):
    return subprocess.run([sys.executable, "pretrain_difflm.py", *TINY_CLI, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_a_corpus_made_with_another_tokenizer_is_refused_at_parse_time(tmp_path):
    prefix = pair_of(tmp_path / "other", [np.arange(40) % 60, np.arange(40) + 100])
    result = run_pretrain("--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert_one_line_error(result, "--data-path", f"{prefix}.bin", "token id 139", "vocabulary of 64 ids",
                          "tools/preprocess_data.py", "--vocab-size")
    assert "iteration" not in result.stdout and "parameters" not in result.stdout, "stopped before building"


@pytest.mark.parametrize("workers", ["0", "2"])
def test_ids_among_the_padding_rows_deep_in_the_corpus_stop_training_at_their_batch(tmp_path, workers):
    """Past the tokens read at parse time, ids 64..123 fit the 128 padded embedding rows (no index
    error, a loss no row can predict); the host-side check of each piece read names the sequence.
    In DataLoader workers the error crosses to the training process without the worker's traceback."""
    good, bad = [np.arange(400) % 60] * 170, [np.arange(400) % 54 + 70] * 170  # 68000 good tokens first
    prefix = pair_of(tmp_path / "late", good + bad)
    result = run_pretrain("--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "10",
                          "--num-workers", workers, "--eval-iters", "0")
    assert result.returncode == 1, result.stderr[-2000:]
    line = [line for line in result.stderr.splitlines() if "error:" in line]
    assert_one_line_error(result, f"{prefix}.bin, sequence ", "is outside this run's vocabulary of 64 ids",
                          "tools/preprocess_data.py")
    sequence, token = map(int, re.search(r"sequence (\d+): token id (\d+) ", line[0]).groups())
    assert 170 <= sequence < 340 and 70 <= token <= 123, line  # a bad sequence, the largest id of its piece


def test_sft_examples_check_their_ids(tmp_path):
    from megatron.core.datasets.sft_dataset import indexed_examples

    tokens = pair_of(tmp_path / "chat", [[1, 2, 3], [4, 99, 5]], dtype=np.int32)
    answers = pair_of(tmp_path / "chat.answer", [[0, 1, 1], [0, 1, 1]], dtype=np.uint8)
    _, get = indexed_examples(IndexedDataset(tokens), IndexedDataset(answers), (0, 2), vocab_size=64)
    assert get(0)[0].tolist() == [1, 2, 3]
    with pytest.raises(InputError, match=re.escape(f"{tokens}.bin, sequence 1: token id 99 is outside")):
        get(1)
