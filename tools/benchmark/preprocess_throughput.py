"""Tokenization throughput of tools/preprocess_data.py on the bundled corpus, per tokenizer type.

    python tools/benchmark/preprocess_throughput.py [--workers 2] [--repeats 3]

SentencePiece uses the bundled examples/data/tokenizer/spm_8k.model. The Hugging Face and
GPT-2 BPE tokenizers are byte-level BPEs of the same vocabulary size trained here on the same
corpus with the `tokenizers` library (nothing is downloaded). The NullTokenizer reads the
corpus as whitespace-separated ids (the SentencePiece ids), i.e. JSON parsing plus int
conversion. Prints the median of --repeats runs; docs/performance.md records the results.
"""

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

import preprocess_data  # noqa: E402

CORPUS = os.path.join(ROOT, "examples/data/sotu_1790_1928.jsonl.gz")
SPM = os.path.join(ROOT, "examples/data/tokenizer/spm_8k.model")


def texts():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def train_byte_level_bpe(workdir: str, vocab_size: int = 8192):
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts(), vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|mask|>"])
    tokenizer.save(os.path.join(workdir, "tokenizer.json"))
    tokenizer.save_model(workdir)  # vocab.json + merges.txt for the GPT-2 BPE tokenizer
    return tuple(os.path.join(workdir, name) for name in ("tokenizer.json", "vocab.json", "merges.txt"))


def ids_corpus(workdir: str) -> str:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=SPM)
    path = os.path.join(workdir, "ids.jsonl")
    with open(path, "w") as handle:
        for text in texts():
            handle.write(json.dumps({"text": " ".join(map(str, processor.encode(text)))}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        hf_json, vocab, merges = train_byte_level_bpe(workdir)
        cases = {
            "SentencePieceTokenizer": (CORPUS, ["--tokenizer-model", SPM]),
            "HuggingFaceTokenizer": (CORPUS, ["--tokenizer-model", hf_json]),
            "GPT2BPETokenizer": (CORPUS, ["--vocab-file", vocab, "--merge-file", merges]),
            "NullTokenizer": (ids_corpus(workdir), ["--vocab-size", "8192"]),
        }
        rows = []
        for name, (source, flags) in cases.items():
            rates, counts = [], None
            for repeat in range(args.repeats):
                start = time.perf_counter()
                output = os.path.join(workdir, f"out{repeat}")
                counts = preprocess_data.main(["--input", source, "--output-prefix", output,
                                               "--tokenizer-type", name, "--append-eod", "--workers",
                                               str(args.workers), *flags])
                rates.append((time.perf_counter() - start, counts["tokens"]))
            seconds = statistics.median(r[0] for r in rates)
            rows.append((name, counts["documents"], counts["tokens"], seconds, counts["tokens"] / seconds))
    print(f"\n| tokenizer | documents | tokens | seconds (median of {args.repeats}) | tokens/s |")
    print("|---|---|---|---|---|")
    for name, docs, tokens, seconds, rate in rows:
        print(f"| {name} | {docs} | {tokens:,} | {seconds:.2f} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
