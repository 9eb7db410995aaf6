"""Verifiable rewards: how well a completion answers a task, in [0, 1].

A task is the dict of its fields, as one line of a task file holds them (tasks.py describes the
schema; `TaskRecord.fields()` gives the dict): `reward` names the kind of check, `answer` the
reference, and the kind's own fields (`pattern`, `tolerance`, `checker`, `numbers` and `target`,
`puzzle`) the rest. `extract_answer` takes what a completion answers: the last
<answer>...</answer>, else the last \\boxed{...}, else the last non-empty line.

`score` checks one completion in this process; a malformed completion scores 0.0 and never
raises (only a `python` checker's own exception goes through). `RewardWorkers` scores many in
worker processes, with a timeout per completion: a checker that hangs, raises or kills its
process scores 0.0, is counted (`timeouts`, `errors`), and its worker is replaced.

Standard library only, so that the worker processes start fast (no torch, no CUDA).
"""

import ast
import collections
import dataclasses
import importlib.util
import math
import multiprocessing
import multiprocessing.connection
import operator
import os
import re
import sys
import time
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

DEFAULT_TOLERANCE = 1e-6  # relative, for reward "numeric" when a task gives none
MAX_EXPRESSION_CHARS = 1000  # a longer countdown answer scores 0.0 unparsed
STARTUP_TIMEOUT_S = 60.0  # a worker that has not started by then is a broken setup, not a bad completion
READY = "ready"

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,4})?")
_BOXED = "\\boxed{"
_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_EXPRESSION_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.USub) + tuple(_BINARY_OPS)
_CHECKERS: Dict[Tuple[str, int], Callable] = {}  # (path, mtime) -> its reward function, per process


# ------------------------------------------------------------------------------------ extraction
def extract_answer(completion: str) -> str:
    """What `completion` answers, stripped: the content of its last <answer>...</answer>, else of
    its last balanced \\boxed{...}, else its last non-empty line ("" for none)."""
    if not isinstance(completion, str):
        return ""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    lines = [line for line in completion.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{ whose braces close, or None. An opening that does not close
    before the next one starts never closes (the later one's unclosed brace stays open), so each
    stretch of text is scanned once."""
    limit = len(text)
    start = text.rfind(_BOXED)
    while start != -1:
        depth = 0
        for end in range(start + len(_BOXED) - 1, limit):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start + len(_BOXED):end]
        limit = start
        start = text.rfind(_BOXED, 0, start)
    return None


def last_number(text: str) -> Optional[Fraction]:
    """The last number in `text` (commas removed: "1,234" is 1234), exactly, or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    try:
        return Fraction(found[-1])
    except (ValueError, ZeroDivisionError, OverflowError):  # e.g. over Python's int-digits limit
        return None


# ------------------------------------------------------------------------------------ the kinds
def _collapse(text: str) -> str:
    return " ".join(text.split())


def score_exact(fields: Mapping, completion: str) -> float:
    """1.0 when the extracted answer equals `answer`, whitespace collapsed and stripped."""
    return float(_collapse(extract_answer(completion)) == _collapse(fields["answer"]))


def score_regex(fields: Mapping, completion: str) -> float:
    """1.0 when `pattern` matches the whole extracted answer."""
    return float(re.fullmatch(fields["pattern"], extract_answer(completion)) is not None)


def score_numeric(fields: Mapping, completion: str) -> float:
    """1.0 when the last number of the extracted answer is within `tolerance` (relative, floored at
    an absolute tolerance for |answer| < 1) of the last number of `answer`."""
    got, wanted = last_number(extract_answer(completion)), last_number(fields["answer"])
    if got is None or wanted is None:
        return 0.0
    tolerance = fields.get("tolerance")
    tolerance = Fraction(DEFAULT_TOLERANCE if tolerance is None else tolerance)
    return float(abs(got - wanted) <= tolerance * max(1, abs(wanted)))


def load_checker(path: str) -> Callable:
    """The `reward(completion, answer, prompt)` function of the checker file at `path`, loaded once
    per process and file version."""
    key = (os.path.abspath(path), os.stat(path).st_mtime_ns)
    if key not in _CHECKERS:
        spec = importlib.util.spec_from_file_location(f"rl_checker_{len(_CHECKERS)}", key[0])
        if spec is None or spec.loader is None:
            raise ValueError(f"checker {path}: not a loadable Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        reward = getattr(module, "reward", None)
        if not callable(reward):
            raise ValueError(f"checker {path}: defines no function reward(completion, answer, prompt)")
        _CHECKERS[key] = reward
    return _CHECKERS[key]


def score_python(fields: Mapping, completion: str) -> float:
    """The checker file's `reward(completion, answer, prompt)`, clipped to [0, 1] (NaN is 0.0).
    The checker's own exceptions go through: they are its bugs, which RewardWorkers counts."""
    reward = load_checker(fields["checker"])
    value = float(reward(completion, fields["answer"], fields["prompt"]))
    return 0.0 if math.isnan(value) else min(1.0, max(0.0, value))


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand)
    return _BINARY_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


def score_countdown(fields: Mapping, completion: str) -> float:
    """1.0 when the extracted answer is an expression of numbers, + - * /, parentheses and unary
    minus only, that uses each of `numbers` exactly once and equals `target` exactly."""
    text = extract_answer(completion)
    if len(text) > MAX_EXPRESSION_CHARS:
        return 0.0
    try:
        tree = ast.parse(text, mode="eval")
        nodes = list(ast.walk(tree))
        if not all(isinstance(node, _EXPRESSION_NODES) for node in nodes):
            return 0.0  # names, calls, attributes, comparisons, **, ...
        used = [node.value for node in nodes if isinstance(node, ast.Constant)]
        if any(type(value) is not int for value in used) or sorted(used) != sorted(fields["numbers"]):
            return 0.0
        return float(_evaluate(tree) == fields["target"])
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError, OverflowError):
        return 0.0


def is_sudoku_solution(grid: str) -> bool:
    """Whether the 16 characters of `grid` (row by row) fill a 4x4 Sudoku: every row, column and
    2x2 box holds 1, 2, 3 and 4 once each."""
    if len(grid) != 16 or any(cell not in "1234" for cell in grid):
        return False
    rows = [[4 * row + col for col in range(4)] for row in range(4)]
    cols = [[4 * row + col for row in range(4)] for col in range(4)]
    boxes = [[4 * (top + row) + left + col for row in range(2) for col in range(2)]
             for top in (0, 2) for left in (0, 2)]
    return all(sorted(grid[cell] for cell in unit) == list("1234") for unit in rows + cols + boxes)


def score_sudoku(fields: Mapping, completion: str) -> float:
    """1.0 when the extracted answer (whitespace and commas dropped) is a 4x4 Sudoku solution that
    keeps every given (non-zero) digit of `puzzle`."""
    grid = re.sub(r"[\s,]", "", extract_answer(completion))
    if not is_sudoku_solution(grid):
        return 0.0
    return float(all(given in ("0", cell) for given, cell in zip(fields["puzzle"], grid)))


def score_sudoku_cells(fields: Mapping, completion: str) -> float:
    """d1's partial credit: the share of the puzzle's blanks that the extracted answer's digits (the
    first 16, read row by row) fill with the reference answer's digit; 1.0 for any solution that
    keeps the givens (a puzzle may have several)."""
    if score_sudoku(fields, completion):
        return 1.0
    digits = re.sub(r"\D", "", extract_answer(completion))[:16]
    blanks = [cell for cell, given in enumerate(fields["puzzle"]) if given == "0"]
    if not blanks:
        return 0.0
    return sum(cell < len(digits) and digits[cell] == fields["answer"][cell] for cell in blanks) / len(blanks)


SCORERS: Dict[str, Callable[[Mapping, str], float]] = {
    "exact": score_exact, "regex": score_regex, "numeric": score_numeric, "python": score_python,
    "countdown": score_countdown, "sudoku": score_sudoku, "sudoku_cells": score_sudoku_cells}


def score(record_fields: Mapping, completion: str) -> float:
    """The reward in [0, 1] of `completion` for the task `record_fields` (its `reward` kind, "exact"
    when absent). A malformed completion scores 0.0."""
    kind = record_fields.get("reward", "exact")
    if kind not in SCORERS:
        raise ValueError(f"reward {kind!r} is not one of {', '.join(SCORERS)}")
    if not isinstance(completion, str):
        return 0.0
    return SCORERS[kind](record_fields, completion)


def as_fields(record: Any) -> Dict[str, Any]:
    """The fields dict of a task given as a dict or as a dataclass (tasks.TaskRecord), unset
    (None) fields left out."""
    if isinstance(record, Mapping):
        return dict(record)
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {name: value for name, value in dataclasses.asdict(record).items() if value is not None}
    raise TypeError(f"a task is a dict or a TaskRecord, not {type(record).__name__}")


# ------------------------------------------------------------------------------------ workers
def _serve(conn) -> None:
    """A worker's loop: score each (index, fields, completion) that arrives, until None or EOF."""
    conn.send(READY)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        index, fields, completion = job
        try:
            reply = (index, True, score(fields, completion))
        except (Exception, SystemExit) as error:  # the checker's bug: reported, counted, scored 0.0
            reply = (index, False, f"{type(error).__name__}: {error}")
        conn.send(reply)


class _Worker:
    """One worker process and its own pipe (a killed worker takes only its own pipe with it)."""

    def __init__(self, context):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name="reward-worker", daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Waits for the worker's READY; RuntimeError if it does not come within timeout_s."""
        try:
            ready = self.conn.poll(timeout_s) and self.conn.recv() == READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.stop(0.0)
            raise RuntimeError(f"a reward worker did not start within {timeout_s:.0f} s (exit code "
                               f"{self.process.exitcode}); check that megatron.rl.rewards imports in a fresh process")

    def stop(self, grace_s: float) -> None:
        """Ends the process: at once with grace_s=0 (SIGTERM, then SIGKILL), else after its job."""
        if grace_s > 0:
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                pass
            self.process.join(grace_s)
        for end in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                end()
                self.process.join(1.0)
        self.conn.close()


class RewardWorkers:
    """Scores (task, completion) pairs in `num_workers` processes, each completion within `timeout_s`.

        with RewardWorkers(num_workers=4, timeout_s=5.0) as workers:
            rewards = workers.score([(record, completion), ...])  # in order

    A completion whose check runs past the timeout, raises, or ends its process scores 0.0; the
    worker is killed and replaced, `timeouts` or `errors` goes up by one, and `last_error` says
    what happened, for training to log. Workers are started with forkserver on Linux (fork is
    unsafe once CUDA is initialised), spawn elsewhere; leaving the `with` block ends them.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0):
        if num_workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardWorkers(num_workers={num_workers}, timeout_s={timeout_s}): "
                             "give at least one worker and a positive timeout")
        self.timeout_s = float(timeout_s)
        self.timeouts = 0
        self.errors = 0
        self.last_error: Optional[str] = None
        self._context = multiprocessing.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")
        self._workers: List[_Worker] = []
        try:
            self._workers = [_Worker(self._context) for _ in range(num_workers)]
            for worker in self._workers:
                worker.wait_ready(STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "RewardWorkers":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def pids(self) -> List[int]:
        """The worker processes' ids (none once closed)."""
        return [worker.process.pid for worker in self._workers]

    def close(self) -> None:
        """Ends every worker (idle ones at once, a busy one after at most a second); idempotent."""
        workers, self._workers = self._workers, []
        for worker in workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in workers:
            worker.stop(1.0)

    def score(self, pairs: Iterable[Tuple[Any, str]]) -> List[float]:
        """The reward of each (task, completion) pair, in order; a task is a dict or a TaskRecord."""
        if not self._workers:
            raise RuntimeError("RewardWorkers.score after close(); make a new RewardWorkers")
        jobs = [(as_fields(record), completion) for record, completion in pairs]
        scores = [0.0] * len(jobs)
        waiting = collections.deque(range(len(jobs)))
        running: Dict[int, Tuple[int, float]] = {}  # worker slot -> (job index, deadline)
        while waiting or running:
            self._dispatch(jobs, waiting, running)
            self._collect(running, scores)
        return scores

    def _dispatch(self, jobs, waiting, running) -> None:
        """Gives each idle worker the next job; a worker found dead while idle is replaced first."""
        for slot, worker in enumerate(self._workers):
            if slot in running or not waiting:
                continue
            if not worker.process.is_alive():
                worker = self._replace(slot)
            index = waiting.popleft()
            try:
                worker.conn.send((index, *jobs[index]))
            except (OSError, ValueError) as error:
                self._failed(slot, "errors", f"could not send a task to a reward worker ({error})")
                continue
            running[slot] = (index, time.monotonic() + self.timeout_s)

    def _collect(self, running, scores) -> None:
        """Waits until a running job ends or its deadline passes; records what ended."""
        if not running:
            return
        owners = {}
        for slot in running:
            worker = self._workers[slot]
            owners[worker.conn] = owners[worker.process.sentinel] = slot
        timeout = max(0.0, min(deadline for _, deadline in running.values()) - time.monotonic())
        for slot in {owners[ready] for ready in multiprocessing.connection.wait(list(owners), timeout)}:
            index, _ = running.pop(slot)
            reply = self._receive(slot)
            if reply is None:
                self._failed(slot, "errors", f"a reward worker died (exit code {self._workers[slot].process.exitcode})")
            elif reply[0] != index:
                self._failed(slot, "errors", f"a reward worker answered task {reply[0]} for task {index}")
            elif reply[1]:
                scores[index] = reply[2]
            else:
                self.errors += 1
                self.last_error = f"task {index}: the check raised {reply[2]}"
        now = time.monotonic()
        for slot, (index, deadline) in list(running.items()):
            if deadline <= now:
                del running[slot]
                self._failed(slot, "timeouts", f"task {index}: the check ran past {self.timeout_s:g} s")

    def _receive(self, slot: int) -> Optional[tuple]:
        """The reply waiting on the slot's pipe, or None when the worker died instead."""
        conn = self._workers[slot].conn
        try:
            if conn.poll():
                reply = conn.recv()
                if isinstance(reply, tuple) and len(reply) == 3:
                    return reply
        except Exception:  # EOF, a broken pipe, a reply cut short by the process's death
            pass
        return None

    def _failed(self, slot: int, counter: str, message: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        self.last_error = message
        self._replace(slot)

    def _replace(self, slot: int) -> _Worker:
        self._workers[slot].stop(0.0)
        worker = _Worker(self._context)
        self._workers[slot] = worker
        worker.wait_ready(STARTUP_TIMEOUT_S)
        return worker
