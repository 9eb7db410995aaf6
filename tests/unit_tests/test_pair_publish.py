"""pair_publish.py: a crash at any rename of a .bin/.idx publish leaves a readable corpus, the earlier
one until the token .idx is renamed and the new one after, answer pairs with their corpus."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets import pair_publish
from megatron.core.datasets.indexed_dataset import (ANSWER_DTYPE, IndexedDataset, IndexedDatasetBuilder,
                                                    get_answer_prefix)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preprocess_data  # noqa: E402


def _write(prefix: str, sequences, dtype=np.uint16) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for sequence in sequences:
        builder.add_document(np.array(sequence, dtype=dtype), [len(sequence)])
    builder.finalize(prefix + ".idx")


def _corpus(folder: Path, name: str, tokens, answers=None) -> str:
    """A token pair (and an answer pair) under `folder/name`; returns the prefix."""
    prefix = str(folder / name)
    _write(prefix, tokens)
    if answers is not None:
        _write(get_answer_prefix(prefix), answers, ANSWER_DTYPE)
    return prefix


def _read(prefix: str):
    tokens = [IndexedDataset(prefix)[i].tolist() for i in range(len(IndexedDataset(prefix)))]
    if not IndexedDataset.exists(get_answer_prefix(prefix)):
        return tokens, None
    answers = IndexedDataset(get_answer_prefix(prefix))
    return tokens, [answers[i].tolist() for i in range(len(answers))]


OLD = ([[1, 2, 3], [4, 5]], [[0, 1, 1], [1, 0]])
NEW = ([[7, 8], [9], [10, 11, 12, 13]], [[1, 1], [0], [0, 0, 1, 1]])


def _stage(tmp_path: Path, tokens, answers):
    staged = _corpus(tmp_path / "staged", "new", tokens, answers)
    pairs = {str(tmp_path / "out" / "corpus"): (staged + ".bin", staged + ".idx")}
    answer_files = (None, None) if answers is None else (get_answer_prefix(staged) + ".bin",
                                                         get_answer_prefix(staged) + ".idx")
    pairs[get_answer_prefix(str(tmp_path / "out" / "corpus"))] = answer_files
    return pairs


class Crash(Exception):
    pass


def _crash_at(monkeypatch, rename: int) -> None:
    """os.replace raises at its `rename`-th call (1-based) from now on."""
    real, calls = os.replace, []

    def replace(source, target):
        calls.append(target)
        if len(calls) == rename:
            raise Crash(target)
        real(source, target)

    monkeypatch.setattr(pair_publish.os, "replace", replace)


@pytest.mark.parametrize("new_answers", [True, False], ids=["chat-over-chat", "plain-over-chat"])
@pytest.mark.parametrize("rename", [1, 2, 3, 4])
def test_a_crash_at_any_rename_leaves_the_old_or_the_new_corpus_whole(tmp_path, monkeypatch, rename, new_answers):
    (tmp_path / "out").mkdir()
    prefix = _corpus(tmp_path / "out", "corpus", *OLD)
    (tmp_path / "staged").mkdir()
    new = NEW if new_answers else (NEW[0], None)
    pairs = _stage(tmp_path, *new)
    renames = 4 if new_answers else 2  # plain: the stale answer pair is removed, not renamed
    _crash_at(monkeypatch, rename)
    if rename > renames:
        pair_publish.publish_pairs(pairs)
        assert _read(prefix) == new
        return
    with pytest.raises(Crash):
        pair_publish.publish_pairs(pairs)
    assert _read(prefix) == OLD  # the token .idx, the commit, is the last rename
    monkeypatch.undo()
    pairs = _stage(tmp_path, *new)  # the next run publishes over the crashed one
    pair_publish.publish_pairs(pairs)
    assert _read(prefix) == new
    assert not [name for name in os.listdir(tmp_path / "out") if name.endswith(pair_publish.PREVIOUS)]


def test_a_crash_after_the_commit_reads_the_new_corpus_and_the_next_publish_cleans_up(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    prefix = _corpus(tmp_path / "out", "corpus", *OLD)
    (tmp_path / "staged").mkdir()

    def crash(folder):
        raise Crash(folder)

    monkeypatch.setattr(pair_publish, "fsync_path", crash)  # every rename done, the backups still there
    with pytest.raises(Crash):
        pair_publish.publish_pairs(_stage(tmp_path, *NEW))
    assert any(name.endswith(pair_publish.PREVIOUS) for name in os.listdir(tmp_path / "out"))
    assert _read(prefix) == NEW
    monkeypatch.undo()
    pair_publish.publish_pairs(_stage(tmp_path, *OLD))
    assert _read(prefix) == OLD
    assert not [name for name in os.listdir(tmp_path / "out") if name.endswith(pair_publish.PREVIOUS)]


def test_a_first_publish_and_a_clean_one_leave_no_backups(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "staged").mkdir()
    prefix = str(tmp_path / "out" / "corpus")
    pair_publish.publish_pairs(_stage(tmp_path, *NEW))
    assert _read(prefix) == NEW
    pair_publish.publish_pairs(_stage(tmp_path, *OLD))
    assert _read(prefix) == OLD
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.answer.bin", "corpus.answer.idx", "corpus.bin",
                                                   "corpus.idx"]


def test_preprocessing_killed_between_its_renames_keeps_the_earlier_corpus_readable(tmp_path, monkeypatch):
    """The tool end to end: the second run dies after its .bin rename; training still reads the first."""
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--workers", "1"]
    for name, text in (("first", "1 2 3\n4 5"), ("second", "6 7 8 9")):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"text": "{line}"}}\n' for line in text.split("\n")))
    out = str(tmp_path / "out")
    preprocess_data.main(["--input", str(tmp_path / "first.jsonl"), "--output-prefix", out, *null])
    _crash_at(monkeypatch, 2)  # the .bin is renamed, the .idx is not
    with pytest.raises(Crash):
        preprocess_data.main(["--input", str(tmp_path / "second.jsonl"), "--output-prefix", out, *null])
    dataset = IndexedDataset(out + "_text_document")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [4, 5]]
