"""Tokenize jsonl / jsonl.gz into Megatron-LM's .bin/.idx format.

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model spm.model --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx` (one file pair per --json-keys entry), byte-
compatible with Megatron-LM. With --partitions K the input is cut into K contiguous line
ranges tokenized in parallel and merged in order, so the output is the same as with K=1.
A malformed line is reported with its number and skipped (counted at the end), or stops
the run with --strict. Light on purpose: no torch, no distributed stack, no training code.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import (IndexedDatasetBuilder, get_bin_path, get_idx_path,  # noqa: E402
                                                    optimal_dtype)
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer  # noqa: E402

_TOKENIZER = None  # one per worker process, built by the pool initializer


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    group = parser.add_argument_group("input and output")
    group.add_argument("--input", required=True, help="A .jsonl or .jsonl.gz file, one JSON object per line.")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to tokenize (one output each).")
    group.add_argument("--output-prefix", required=True, help="Writes {prefix}_{key}_document.bin/.idx.")
    group.add_argument("--append-eod", action="store_true", help="End every document with the EOD token.")
    group.add_argument("--strict", action="store_true", help="Stop at the first malformed line.")
    add_tokenizer_args(parser.add_argument_group("tokenizer"))
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Tokenizer processes in all.")
    group.add_argument("--partitions", type=int, default=1, help="Contiguous input ranges processed in parallel.")
    group.add_argument("--log-interval", type=int, default=1000, help="Progress line every N documents "
                                                                      "when stderr is not a terminal.")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: file not found")
    if args.workers < 1 or args.partitions < 1:
        parser.error("--workers and --partitions must be >= 1")
    args.mask_token = None
    try:
        args.tokenizer = build_tokenizer(args)  # fail here, once, on a bad tokenizer file
    except (ValueError, FileNotFoundError, OSError) as error:
        parser.error(str(error))
    return args


def open_lines(path: str) -> Iterator[Tuple[int, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            yield number, line


def _init_worker(args: argparse.Namespace) -> None:
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(args)


def encode_line(item: Tuple[int, str, Tuple[str, ...], bool]):
    """-> (line number, {key: token ids} or None, error or None, characters read)."""
    number, line, keys, append_eod = item
    if not line.strip():
        return number, None, "empty line", len(line)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return number, None, f"not valid JSON ({error.msg})", len(line)
    if not isinstance(record, dict):
        return number, None, "not a JSON object", len(line)
    missing = [key for key in keys if not isinstance(record.get(key), str)]
    if missing:
        return number, None, f"no string field {missing[0]!r}", len(line)
    encoded = {}
    for key in keys:
        ids = _TOKENIZER.tokenize(record[key])
        if append_eod and ids:
            ids = ids + [_TOKENIZER.eod]
        encoded[key] = ids
    return number, encoded, None, len(line)


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


class Progress:
    """docs/s and tokens/s: a tqdm bar on a terminal, periodic lines otherwise (logs)."""

    def __init__(self, log_interval: int, position: int = 0, label: str = "") -> None:
        self.start, self.docs, self.tokens = time.time(), 0, 0
        self.log_interval, self.label = log_interval, label
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(unit="docs", position=position, desc=label or "tokenizing", dynamic_ncols=True)

    def update(self, tokens: int) -> None:
        self.docs += 1
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            if self.docs % 100 == 0:
                self.bar.set_postfix(tokens_per_s=f"{self.rate()[1]:,.0f}")
        elif self.docs % self.log_interval == 0:
            print(self.summary(), file=sys.stderr, flush=True)

    def rate(self) -> Tuple[float, float]:
        elapsed = max(time.time() - self.start, 1e-9)
        return self.docs / elapsed, self.tokens / elapsed

    def summary(self) -> str:
        docs_per_s, tokens_per_s = self.rate()
        return (f"{self.label}processed {self.docs} documents, {self.tokens} tokens "
                f"({docs_per_s:,.1f} docs/s, {tokens_per_s:,.0f} tokens/s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def worker_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags without the built tokenizer object (rebuilt in each worker; not picklable)."""
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "tokenizer"})


def tokenize_range(args: argparse.Namespace, lines: Tuple[int, int], prefix: str, workers: int,
                   label: str = "", position: int = 0) -> Dict[str, int]:
    """Tokenize input lines [first, last) into `{prefix}_{key}_document.*`; returns counts."""
    first, last = lines
    dtype = optimal_dtype(args.tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(get_bin_path(output_prefix(prefix, key)), dtype=dtype)
                for key in args.json_keys}
    items = ((n, line, tuple(args.json_keys), args.append_eod) for n, line in open_lines(args.input)
             if first <= n < last)
    progress, skipped = Progress(args.log_interval, position, label), 0
    plain_args = worker_args(args)
    if workers == 1:
        _init_worker(plain_args)
        results, pool = map(encode_line, items), None
    else:
        pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(plain_args,))
        results = pool.imap(encode_line, items, chunksize=32)
    try:
        for number, encoded, error, _ in results:
            if error is not None:
                message = f"{args.input}:{number}: {error}"
                if args.strict:
                    raise SystemExit(f"error: {message} (--strict)")
                skipped += 1
                if skipped <= 10:
                    print(f"warning: skipping {message}", file=sys.stderr)
                continue
            for key, ids in encoded.items():
                builders[key].add_item(ids)
                builders[key].end_document()
            progress.update(sum(len(ids) for ids in encoded.values()))
    finally:
        if pool is not None:
            pool.terminate()
        progress.close()
    for key, builder in builders.items():
        builder.finalize(get_idx_path(output_prefix(prefix, key)))
    return {"documents": progress.docs, "tokens": progress.tokens, "skipped": skipped}


def _partition_main(args, lines, prefix, workers, index, queue) -> None:
    try:
        queue.put((index, tokenize_range(args, lines, prefix, workers, f"[part {index}] ", index)))
    except SystemExit as error:
        queue.put((index, str(error)))


def tokenize_partitions(args: argparse.Namespace) -> Dict[str, int]:
    """Contiguous line ranges in parallel processes, then merged in order."""
    total_lines = sum(1 for _ in open_lines(args.input))
    bounds = [1 + round(k * total_lines / args.partitions) for k in range(args.partitions + 1)]
    part_prefixes = [f"{args.output_prefix}_part{k}" for k in range(args.partitions)]
    workers = max(1, args.workers // args.partitions)
    queue = multiprocessing.Queue()
    processes = [multiprocessing.Process(target=_partition_main,
                                         args=(args, (bounds[k], bounds[k + 1]), part_prefixes[k], workers, k, queue))
                 for k in range(args.partitions)]
    for process in processes:
        process.start()
    results = dict(queue.get() for _ in processes)
    for process in processes:
        process.join()
    errors = [result for result in results.values() if isinstance(result, str)]
    if errors:
        raise SystemExit(errors[0])
    for key in args.json_keys:
        merged = IndexedDatasetBuilder(get_bin_path(output_prefix(args.output_prefix, key)),
                                       dtype=optimal_dtype(args.tokenizer.vocab_size))
        for part in part_prefixes:
            merged.add_index(output_prefix(part, key))
        merged.finalize(get_idx_path(output_prefix(args.output_prefix, key)))
        for part in part_prefixes:
            os.remove(get_bin_path(output_prefix(part, key)))
            os.remove(get_idx_path(output_prefix(part, key)))
    return {name: sum(r[name] for r in results.values()) for name in ("documents", "tokens", "skipped")}


def main(argv: Optional[List[str]] = None) -> Dict[str, int]:
    args = get_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    start = time.time()
    if args.partitions == 1:
        counts = tokenize_range(args, (1, sys.maxsize), args.output_prefix, args.workers)
    else:
        counts = tokenize_partitions(args)
    elapsed = max(time.time() - start, 1e-9)
    outputs = ", ".join(output_prefix(args.output_prefix, key) + ".{bin,idx}" for key in args.json_keys)
    print(f"wrote {outputs}: {counts['documents']} documents, {counts['tokens']} tokens in {elapsed:.1f} s "
          f"({counts['documents'] / elapsed:,.1f} docs/s, {counts['tokens'] / elapsed:,.0f} tokens/s)"
          + (f"; skipped {counts['skipped']} malformed lines" if counts["skipped"] else ""), file=sys.stderr)
    return counts


if __name__ == "__main__":
    main()
