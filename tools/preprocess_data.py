"""Tokenize jsonl / jsonl.gz into Megatron-LM's .bin/.idx format.

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model spm.model --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx` (one file pair per --json-keys entry), byte-
compatible with Megatron-LM. With --chat the lines are conversations or prompt/response records
(SFT data, megatron/training/tokenizer/chat_template.py): one document per example, plus the answer
mask `data/corpus_text_document.answer.bin/.idx` (uint8, 1 = answer token, 0 = prompt).
With --partitions K the input is cut into K contiguous line ranges tokenized in parallel and
merged in order, so the output is the same as with K=1.
A malformed line is reported with its number and skipped (counted at the end), or stops
the run with --strict. Light on purpose: no torch, no distributed stack, no training code.

Outputs are written under temporary names and renamed into place only when the whole run
succeeded, so a failed or killed run leaves an earlier pair byte-for-byte as it was (a
SIGKILLed run may leave `*.tmp-<pid>*` files behind, safe to delete). A kill between the
renames too: `megatron/core/datasets/pair_publish.py` keeps the earlier pair as hard links that
readers use until the token .idx, the last rename, is in place. Bad
input, a dead worker or a full disk end the run with one line `error: ...` and a non-zero
exit (2 for a bad flag, as argparse does; 1 otherwise), never a traceback or a hang.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Dict, Iterator, List, NoReturn, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import (ANSWER_DTYPE, IndexedDatasetBuilder,  # noqa: E402
                                                    get_answer_prefix, get_bin_path, get_idx_path, optimal_dtype)
from megatron.core.datasets.pair_publish import fsync_path, publish_pairs  # noqa: E402
from megatron.core.errors import InputError  # noqa: E402
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer, chat_template  # noqa: E402

_TOKENIZER = None  # one per worker process, built by the pool initializer
_CHAT = None  # the worker's chat_template.ChatEncoder with --chat
ANSWER_KEY = "answer"  # the output of the answer flags (--chat forces --json-keys text, so no clash)
_CHAT_DEFAULTS = {"chat_template": "auto", "chat_turns": "all", "seed": 1234, "prompt_key": "prompt",
                  "response_key": list(chat_template.DEFAULT_RESPONSE_KEYS)}
_BATCH = 32  # lines per task sent to a tokenizer worker
_POLL_S = 0.2  # how often the parent looks for a partition process that died


class WorkerDied(RuntimeError):
    """A tokenizer or partition process ended without its result (killed, out of memory)."""


def _usage_error(message: str) -> NoReturn:
    # argparse's parser.error would bury the one line that matters under the usage block.
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    group = parser.add_argument_group("input and output")
    group.add_argument("--input", required=True, help="A .jsonl or .jsonl.gz file, one JSON object per line.")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to tokenize (one output each).")
    group.add_argument("--output-prefix", required=True, help="Writes {prefix}_{key}_document.bin/.idx.")
    group.add_argument("--append-eod", action="store_true", help="End every document with the EOD token.")
    group.add_argument("--strict", action="store_true", help="Stop at the first malformed line.")
    add_tokenizer_args(parser.add_argument_group("tokenizer"))
    _add_chat_args(parser.add_argument_group("chat (SFT) data"))
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Tokenizer processes in all.")
    group.add_argument("--partitions", type=int, default=1, help="Contiguous input ranges processed in parallel.")
    group.add_argument("--log-interval", type=int, default=1000, help="Progress line every N documents "
                                                                      "when stderr is not a terminal.")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        _usage_error(f"--input {args.input}: file not found; give an existing .jsonl or .jsonl.gz file")
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            _usage_error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    args.mask_token = None
    try:
        args.tokenizer = build_tokenizer(args)  # fail here, once, on a bad tokenizer file
    except (ValueError, FileNotFoundError, OSError) as error:
        _usage_error(str(error))
    _check_chat_args(args)
    return args


def _add_chat_args(group) -> None:
    group.add_argument("--chat", action="store_true",
                       help="Lines are conversations {\"messages\": [{\"role\", \"content\"}, ...]} or prompt/"
                            "response records; also writes {prefix}_text_document.answer.bin/.idx (1 = answer token).")
    group.add_argument("--chat-template", help="auto (default: the HF tokenizer's chat_template, else builtin), "
                                               "builtin, none (plain concatenation) or a .jinja file.")
    group.add_argument("--chat-turns", choices=chat_template.TURN_CHOICES,
                       help="all (default): every assistant turn is an answer; sampled: one drawn per conversation "
                            "(LLaDA), history as prompt; each: one example per assistant turn.")
    group.add_argument("--seed", type=int, help="Seed of the --chat-turns sampled draw (default 1234).")
    group.add_argument("--prompt-key", help="Prompt field of prompt/response records (default prompt).")
    group.add_argument("--response-key", nargs="+", help="Response fields, the first present is used "
                                                         "(default response completion answer).")


def _check_chat_args(args: argparse.Namespace) -> None:
    """Fills the chat defaults; a chat flag without --chat would change nothing, so it is refused."""
    for dest, default in _CHAT_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif not args.chat:
            _usage_error(f"--{dest.replace('_', '-')} needs --chat; add --chat or drop it")
    if not args.chat:
        return
    if args.json_keys != ["text"]:
        _usage_error("--json-keys does not apply with --chat (examples go to {prefix}_text_document); drop it")
    try:
        args.chat_template_source, name = chat_template.resolve_template(args.chat_template, args.tokenizer)
    except ValueError as error:
        _usage_error(str(error))
    if args.chat_template == "auto":
        print(f"--chat-template auto: using {name}", file=sys.stderr)


def open_lines(path: str) -> Iterator[Tuple[int, str]]:
    """(number, text) of every line; InputError naming the file and line on broken input."""
    opener = gzip.open if path.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                yield number, line
    except UnicodeDecodeError:
        raise InputError(f"--input {path}:{_first_non_utf8(path, opener)}: not UTF-8 text; re-encode "
                         "the file as UTF-8 (e.g. iconv -t utf-8) or remove that line") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise InputError(f"--input {path}: broken gzip data after line {number} ({error}); "
                         "re-compress it, or give the uncompressed .jsonl") from None


def _first_non_utf8(path: str, opener) -> str:
    """'line: column' of the first byte that is not UTF-8.

    Text-mode decoding fails on a whole read-ahead chunk, so its error cannot tell the line;
    a second pass in binary can (a newline byte never sits inside a UTF-8 character).
    """
    with opener(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"{number}: byte 0x{raw[error.start]:02x} at column {error.start + 1}"
    return "?"


def _init_worker(args: argparse.Namespace) -> None:
    global _TOKENIZER, _CHAT
    _TOKENIZER = build_tokenizer(args)
    _CHAT = (chat_template.ChatEncoder(_TOKENIZER, args.chat_template_source, args.chat_turns, args.seed,
                                       args.prompt_key, args.response_key) if args.chat else None)


def encode_line(item: Tuple[int, str, Tuple[str, ...], bool]):
    """-> (line number, [{key: token ids} per document] or None, error or None, characters read)."""
    number, line, keys, append_eod = item
    if not line.strip():
        return number, None, "empty line", len(line)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return number, None, f"not valid JSON ({error.msg})", len(line)
    if not isinstance(record, dict):
        return number, None, "not a JSON object", len(line)
    if _CHAT is not None:
        try:
            examples = _CHAT.encode_record(record, number)
        except ValueError as error:  # a malformed conversation, or text the tokenizer cannot read
            return number, None, str(error), len(line)
        return number, [{"text": ids, ANSWER_KEY: flags} for ids, flags in examples], None, len(line)
    missing = [key for key in keys if not isinstance(record.get(key), str)]
    if missing:
        return number, None, f"no string field {missing[0]!r}", len(line)
    encoded = {}
    for key in keys:
        try:
            ids = _TOKENIZER.tokenize(record[key])
        except ValueError as error:  # text this tokenizer cannot read (e.g. words for the NullTokenizer)
            return number, None, f"the tokenizer rejected field {key!r} ({error})", len(line)
        if append_eod and ids:
            ids = ids + [_TOKENIZER.eod]
        encoded[key] = ids
    return number, [encoded], None, len(line)


def encode_batch(items: list) -> list:
    # Looks encode_line up at call time, so a test can replace it to make a worker die.
    return [encode_line(item) for item in items]


def _ordered_results(executor: ProcessPoolExecutor, max_pending: int, items: Iterator) -> Iterator:
    """encode_line over `items` in input order, with at most `max_pending` batches in flight.

    Executor.map would submit the whole input at once (the corpus in memory); the bound keeps
    memory flat. BrokenProcessPool (a worker was killed) becomes one clear error.
    """
    pending = collections.deque()
    batches = iter(lambda: list(itertools.islice(items, _BATCH)), [])
    try:
        for batch in batches:
            pending.append(executor.submit(encode_batch, batch))
            if len(pending) >= max_pending:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    except BrokenProcessPool:
        raise WorkerDied("a tokenizer worker process died (killed, or out of memory?); re-run, with "
                         "fewer --workers if memory is short") from None


@contextlib.contextmanager
def _encoder(args: argparse.Namespace, workers: int):
    """Yields a function from items to encode_line results, computed on `workers` processes.

    Not multiprocessing.Pool: it silently replaces a worker that dies and then waits forever
    for the lost results; ProcessPoolExecutor raises BrokenProcessPool instead.
    """
    plain_args = worker_args(args)
    if workers == 1:
        _init_worker(plain_args)
        yield lambda items: map(encode_line, items)
        return
    executor = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(plain_args,))
    try:
        yield lambda items: _ordered_results(executor, 4 * workers, iter(items))
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def output_prefixes(args: argparse.Namespace) -> Dict[str, str]:
    """Every output pair's prefix by key: one per --json-keys entry, and the answer mask with --chat."""
    prefixes = {key: output_prefix(args.output_prefix, key) for key in args.json_keys}
    if args.chat:
        prefixes[ANSWER_KEY] = get_answer_prefix(prefixes["text"])
    return prefixes


def output_dtype(args: argparse.Namespace, key: str):
    return ANSWER_DTYPE if args.chat and key == ANSWER_KEY else optimal_dtype(args.tokenizer.vocab_size)


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


def tokenize_range(args: argparse.Namespace, lines: Tuple[int, int], paths: Dict[str, Tuple[str, str]],
                   workers: int, label: str = "", position: int = 0) -> Dict[str, int]:
    """Tokenize input lines [first, last) into each key's (.bin, .idx) `paths`; returns counts."""
    first, last = lines
    builders = {key: IndexedDatasetBuilder(bin_path, dtype=output_dtype(args, key))
                for key, (bin_path, _) in paths.items()}
    items = ((n, line, tuple(args.json_keys), args.append_eod)
             for n, line in itertools.islice(open_lines(args.input), first - 1, last - 1))
    progress, skipped = Progress(args.log_interval, position, label), 0
    with _encoder(args, workers) as encode:
        try:
            for number, encoded, error, _ in encode(items):
                if error is not None:
                    message = f"{args.input}:{number}: {error}"
                    if args.strict:
                        raise InputError(f"{message} (--strict); fix that line, or drop --strict to skip it")
                    skipped += 1
                    if skipped <= 10:
                        print(f"warning: skipping {message}", file=sys.stderr)
                    continue
                for document in encoded:
                    for key, ids in document.items():
                        builders[key].add_item(ids)
                        builders[key].end_document()
                    progress.update(sum(len(document[key]) for key in args.json_keys))
        finally:
            progress.close()
    for key, builder in builders.items():
        builder.finalize(paths[key][1])
    return {"documents": progress.docs, "tokens": progress.tokens, "skipped": skipped}


def _partition_main(args, lines, paths, workers, index, sender) -> None:
    # Its own process group, so that if this process is killed the parent can still end the
    # tokenizer workers it leaves behind (they would otherwise wait for tasks forever).
    os.setpgid(0, 0)
    try:
        sender.send(tokenize_range(args, lines, paths, workers, f"[part {index}] ", index))
    except (InputError, WorkerDied, OSError) as error:
        sender.send(error)  # re-raised by the parent, so it is reported as one line


def _end_partition(process: multiprocessing.Process) -> None:
    """SIGKILL the partition's whole process group: the partition and its tokenizer workers."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()


def _collect(processes: List[multiprocessing.Process], receivers: list) -> List[Dict[str, int]]:
    """Each partition's counts, in order; raises its error, or WorkerDied if one ends without one.

    Liveness is polled (is_alive reaps the exit status) instead of waiting for the sentinel or
    the pipe's end of file: a killed partition's tokenizer workers hold both open.
    """
    results = {}
    while len(results) < len(processes):
        pending = [k for k in range(len(processes)) if k not in results]
        multiprocessing.connection.wait([receivers[k] for k in pending], timeout=_POLL_S)
        for k in pending:
            alive = processes[k].is_alive()  # before poll(): a result sent just before exit is still read
            if receivers[k].poll():
                try:
                    result = receivers[k].recv()
                except EOFError:
                    result = None
            elif alive:
                continue
            else:
                result = None
            if isinstance(result, BaseException):
                raise result
            if result is None:
                processes[k].join(timeout=5)  # its pipe can close a moment before its exit status is known
                code = processes[k].exitcode
                how = (f"killed by signal {-code}, out of memory?" if code is not None and code < 0
                       else f"exit code {code}, see its message above")
                raise WorkerDied(f"--partitions: the process of partition {k} died ({how}) without its "
                                 "result; re-run, with fewer --partitions/--workers if memory is short")
            results[k] = result
    return [results[k] for k in range(len(processes))]


def _run_partitions(args: argparse.Namespace, ranges: list, part_paths: list, workers: int) -> list:
    """One process per line range; their counts, or the first failure raised here."""
    pipes = [multiprocessing.Pipe(duplex=False) for _ in ranges]
    processes = [multiprocessing.Process(target=_partition_main,
                                         args=(args, ranges[k], part_paths[k], workers, k, pipes[k][1]))
                 for k in range(len(ranges))]
    try:
        for process in processes:
            process.start()
            # Also set here: the group must exist even if we kill the child before it runs.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpgid(process.pid, process.pid)
        for _, sender in pipes:
            sender.close()
        return _collect(processes, [receiver for receiver, _ in pipes])
    except BaseException:
        for process in processes:
            if process.pid is not None:
                _end_partition(process)
        raise
    finally:
        for process in processes:
            if process.pid is not None:
                process.join()


def tokenize_partitions(args: argparse.Namespace, paths: Dict[str, Tuple[str, str]]) -> Dict[str, int]:
    """Contiguous line ranges in parallel processes, then merged in order into `paths`."""
    total_lines = sum(1 for _ in open_lines(args.input))
    bounds = [1 + round(k * total_lines / args.partitions) for k in range(args.partitions + 1)]
    ranges = [(bounds[k], bounds[k + 1]) for k in range(args.partitions)]
    part_prefixes = [{key: f"{_temporary(prefix)}-part{k}" for key, prefix in output_prefixes(args).items()}
                     for k in range(args.partitions)]
    part_paths = [{key: (get_bin_path(p), get_idx_path(p)) for key, p in parts.items()} for parts in part_prefixes]
    try:
        results = _run_partitions(args, ranges, part_paths, max(1, args.workers // args.partitions))
        for key in paths:
            merged = IndexedDatasetBuilder(paths[key][0], dtype=output_dtype(args, key))
            for parts in part_prefixes:
                merged.add_index(parts[key])
            merged.finalize(paths[key][1])
    finally:
        _remove_files(path for parts in part_paths for pair in parts.values() for path in pair)
    return {name: sum(r[name] for r in results) for name in ("documents", "tokens", "skipped")}


def _temporary(path: str) -> str:
    # The pid keeps two runs writing the same prefix from clobbering each other's files.
    return f"{path}.tmp-{os.getpid()}"


def _remove_files(paths) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def staged_outputs(args: argparse.Namespace):
    """Yields each key's temporary (.bin, .idx); renamed onto the real names only on success.

    Nothing is overwritten in place (DESIGN.md section 5): a failed run removes its temporary
    files and leaves an earlier pair byte-for-byte as it was.
    """
    finals = {key: (get_bin_path(prefix), get_idx_path(prefix)) for key, prefix in output_prefixes(args).items()}
    temps = {key: (_temporary(bin_path), _temporary(idx_path)) for key, (bin_path, idx_path) in finals.items()}
    try:
        yield temps
        for pair in temps.values():
            for path in pair:
                fsync_path(path)
    except BaseException:
        _remove_files(path for pair in temps.values() for path in pair)
        raise
    # Every pair is complete before the first rename. pair_publish keeps each corpus's earlier pair
    # readable until its token .idx is renamed (the commit), its answer pair with it; an answer pair
    # left by an earlier --chat run goes when this run writes none (it would be read as this pair's).
    for key, prefix in output_prefixes(args).items():
        if key != ANSWER_KEY:
            publish_pairs({prefix: temps[key], get_answer_prefix(prefix): temps.get(ANSWER_KEY, (None, None))})


def _tokenize_into(args: argparse.Namespace, paths: Dict[str, Tuple[str, str]]) -> Dict[str, int]:
    if args.partitions == 1:
        counts = tokenize_range(args, (1, sys.maxsize), paths, args.workers)
    else:
        counts = tokenize_partitions(args, paths)
    if counts["documents"] == 0:
        wanted = ("conversations ({\"messages\": [...]}) or prompt/response records" if args.chat
                  else f"JSON objects with a string under --json-keys {' '.join(args.json_keys)}")
        raise InputError(f"--input {args.input}: no documents to write ({counts['skipped']} malformed lines "
                         f"skipped); give lines that are {wanted}")
    return counts


def main(argv: Optional[List[str]] = None) -> Dict[str, int]:
    args = get_args(argv)
    start = time.time()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    except OSError as error:
        _usage_error(f"--output-prefix {args.output_prefix}: cannot create its folder ({error}); give a writable path")
    try:
        with staged_outputs(args) as paths:
            counts = _tokenize_into(args, paths)
    except (InputError, WorkerDied) as error:
        raise SystemExit(f"error: {error}") from None
    except OSError as error:  # e.g. a full disk: ours to report in one line, not a bug
        raise SystemExit(f"error: {error}; nothing was replaced: check that --output-prefix "
                         f"{args.output_prefix} is writable with space left, and re-run") from None
    elapsed = max(time.time() - start, 1e-9)
    outputs = ", ".join(prefix + ".{bin,idx}" for prefix in output_prefixes(args).values())
    print(f"wrote {outputs}: {counts['documents']} documents, {counts['tokens']} tokens in {elapsed:.1f} s "
          f"({counts['documents'] / elapsed:,.1f} docs/s, {counts['tokens'] / elapsed:,.0f} tokens/s)"
          + (f"; skipped {counts['skipped']} malformed lines" if counts["skipped"] else ""), file=sys.stderr)
    return counts


if __name__ == "__main__":
    main()
