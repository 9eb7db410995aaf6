#!/usr/bin/env python3
"""Train a small SentencePiece tokenizer for masked diffusion LM pretraining.

Reads documents from a JSONL file (optionally gzip-compressed) and trains a SentencePiece model
(BPE by default, or unigram) with byte fallback, writing <output-prefix>.model and
<output-prefix>.vocab. Example (the bundled tokenizer, see examples/data/README.md):

    python tools/train_tokenizer.py --input examples/data/sotu_1790_1928.jsonl.gz \\
        --json-key text --output-prefix examples/data/tokenizer/spm_8k --vocab-size 8192

Special pieces and their ids (fixed by this script, whatever the vocabulary size):

    0  <pad>          padding (pad_id)
    1  <unk>          unknown (unk_id; never produced for text thanks to byte fallback)
    2  <s>            BOS (bos_id)
    3  <|endoftext|>  EOS (eos_id): appended at the end of every document
    4  <|mask|>       the diffusion mask token (a control symbol)

then the 256 byte-fallback pieces <0x00>..<0xFF> (ids 5..260), then the learned pieces.
All five specials are control symbols: ``piece_to_id`` finds them, ``encode`` never produces
them from text (a literal "<|mask|>" in a document is encoded as ordinary characters, so the
mask token only ever appears where the diffusion process puts it), and ``decode`` renders them
as the empty string.

Round trip: normalization is "identity" (no NFKC), extra whitespace is kept and byte fallback is
on, so ``decode(encode(text)) == text`` for any UTF-8 text. Training "sentences" are the
non-empty lines of each document; newlines themselves are encoded with byte fallback (<0x0A>).

Determinism: the training lines are read in file order. When there are more than
--input-sentence-size of them, this script samples that many itself (reservoir sampling with
Python's random.Random(--seed), kept in file order) and hands SentencePiece exactly those lines:
SentencePiece's own sampling (its input_sentence_size) was found to pick different lines from run
to run even after spm.set_random_generator_seed, so it is not used. BPE training is then
deterministic, also across thread counts (checked with sentencepiece 0.2.3: identical pieces with
1 and 2 threads). Unigram training runs its EM steps over --num-threads threads and its pieces
differ with the thread count (but not between runs with the same count). The default
--num-threads is 1 so that either model type is reproducible on any machine.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import sys
import time
from typing import Iterator

PAD, UNK, BOS, EOS, MASK = "<pad>", "<unk>", "<s>", "<|endoftext|>", "<|mask|>"


def open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def iter_lines(paths, json_key: str, max_sentence_length: int) -> Iterator[str]:
    """Non-empty lines of every document's `json_key` text, in file order.

    Lines longer than max_sentence_length bytes (SentencePiece would drop them) are cut at
    spaces into pieces no longer than that.
    """
    for path in paths:
        with open_text(path) as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[json_key]
                except (ValueError, KeyError) as e:
                    raise SystemExit(f"{path}:{n}: no JSON object with key '{json_key}' ({e})")
                for sent in text.split("\n"):
                    if not sent.strip():
                        continue
                    while len(sent.encode("utf-8")) > max_sentence_length:
                        cut = sent.rfind(" ", 0, max_sentence_length // 4)
                        cut = cut if cut > 0 else max_sentence_length // 4
                        yield sent[:cut]
                        sent = sent[cut:]
                    yield sent


def sample_lines(lines: Iterator[str], size: int, seed: int) -> list:
    """All lines if size <= 0 or there are at most `size`; else a seeded uniform sample of `size`
    lines (reservoir sampling, algorithm R), returned in their original order."""
    if size <= 0:
        return list(lines)
    rng = random.Random(seed)
    reservoir: list = []  # (index, line)
    for i, line in enumerate(lines):
        if i < size:
            reservoir.append((i, line))
        else:
            j = rng.randint(0, i)
            if j < size:
                reservoir[j] = (i, line)
    reservoir.sort()
    return [line for _, line in reservoir]


def _train(spm, args, lines: list, model_prefix: str) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=model_prefix,
        model_type=args.model_type,
        vocab_size=args.vocab_size,
        character_coverage=args.character_coverage,
        byte_fallback=True,
        # Keep text round-trippable: no Unicode normalization, keep all whitespace.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=args.split_digits,
        allow_whitespace_only_pieces=True,
        max_sentence_length=args.max_sentence_length,
        input_sentence_size=0,  # sampling is done above, deterministically
        shuffle_input_sentence=False,
        num_threads=args.num_threads,
        # Special pieces (fixed ids 0..4, see the module docstring).
        pad_id=0, pad_piece=PAD,
        unk_id=1, unk_piece=UNK,
        bos_id=2, bos_piece=BOS,
        eos_id=3, eos_piece=EOS,
        control_symbols=[MASK],
        unk_surface=" \u2047 ",
        minloglevel=0 if args.verbose else 2,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", help="JSONL or JSONL.gz file(s)")
    parser.add_argument("--json-key", default="text", help="key of the document text")
    parser.add_argument("--output-prefix", required=True,
                        help="writes <prefix>.model and <prefix>.vocab (folders are created)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9999,
                        help="characters outside it are encoded as UTF-8 bytes")
    parser.add_argument("--input-sentence-size", type=int, default=200000,
                        help="at most this many lines (a seeded sample) train the model; "
                             "0 uses all of them")
    parser.add_argument("--max-sentence-length", type=int, default=16384,
                        help="bytes; longer lines are cut at spaces")
    parser.add_argument("--seed", type=int, default=1234,
                        help="seed of the line sampling (and of SentencePiece's generator)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="1 keeps unigram training bit-reproducible (see above)")
    parser.add_argument("--split-digits", action=argparse.BooleanOptionalAction, default=True,
                        help="encode every digit as its own piece")
    parser.add_argument("--verbose", action="store_true", help="show SentencePiece's log")
    args = parser.parse_args(argv)

    import sentencepiece as spm

    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"--input {path}: no such file")
    out_dir, out_name = os.path.split(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    spm.set_random_generator_seed(args.seed)
    if not args.verbose:
        spm.set_min_log_level(2)
    start = time.time()
    lines = sample_lines(iter_lines(args.input, args.json_key, args.max_sentence_length),
                         args.input_sentence_size, args.seed)
    # Train from inside the output folder with a bare model_prefix: the prefix is stored in the
    # .model file, which then does not depend on where it was written.
    cwd = os.getcwd()
    os.chdir(out_dir)
    try:
        _train(spm, args, lines, out_name)
    finally:
        os.chdir(cwd)
    elapsed = time.time() - start

    sp = spm.SentencePieceProcessor(model_file=args.output_prefix + ".model")
    ids = {name: sp.piece_to_id(name) for name in (PAD, UNK, BOS, EOS, MASK)}
    assert ids == {PAD: 0, UNK: 1, BOS: 2, EOS: 3, MASK: 4}, ids
    assert sp.eos_id() == 3 and sp.bos_id() == 2 and sp.pad_id() == 0 and sp.unk_id() == 1
    sample = "Fellow-Citizens of the Senate and House:\n\nThe 4th of July, 1826 \u2014 \u00bd \u00e9t\u00e9."
    assert sp.decode(sp.encode(sample)) == sample, "tokenizer does not round-trip"
    print(f"wrote {args.output_prefix}.model and .vocab: {sp.get_piece_size()} pieces "
          f"({args.model_type}) from {len(lines)} lines in {elapsed:.1f} s; special ids "
          + ", ".join(f"{k}={v}" for k, v in ids.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
