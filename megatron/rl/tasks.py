"""Tasks with verifiable rewards: the task file, its records, and offline generators.

A task file is JSON Lines (.jsonl, or .jsonl.gz), one task an object:

    {"prompt": "What is 12 * 34? Put the number inside <answer></answer>.", "answer": "408",
     "reward": "numeric", "tolerance": 0}

- `prompt` (string) and `answer` (string), required;
- `reward`, how rewards.py checks a completion: one of REWARD_KINDS, "exact" when absent;
- the kind's own fields: `pattern` (a regular expression the extracted answer must match in
  full; required for "regex"), `tolerance` (>= 0, relative, floored at absolute for |answer| < 1;
  "numeric" only, default 1e-6), `checker` (a .py file defining `reward(completion, answer,
  prompt) -> float`; required for "python"; a relative path is taken from the task file's folder
  and held resolved), `numbers` (list of integers) and `target` (integer), required for
  "countdown", `puzzle` (16 digits 0-4 row by row, 0 a blank), required for "sudoku" (1.0 for a
  solution that keeps the givens) and "sudoku_cells" (d1's partial credit: the share of the blanks
  filled with `answer`'s digit, which is then the 16-digit solution).

`load_tasks` checks the whole file before it returns anything: a bad line is an InputError of one
line naming the file, the line, the field and the fix. `generate_tasks` makes countdown, 4x4
sudoku and arithmetic tasks offline, the same ones for the same seed; `write_tasks` writes a file
that `load_tasks` reads back equal.
"""

import dataclasses
import gzip
import json
import math
import os
import random
import re
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from megatron.core.errors import InputError
from megatron.rl import rewards

REWARD_KINDS = ("exact", "regex", "numeric", "python", "countdown", "sudoku", "sudoku_cells")
GENERATOR_KINDS = ("countdown", "sudoku", "arithmetic", "addition")
FIELDS = ("prompt", "answer", "reward", "pattern", "tolerance", "checker", "numbers", "target", "puzzle")
KIND_FIELDS = {"exact": (), "regex": ("pattern",), "numeric": ("tolerance",), "python": ("checker",),
               "countdown": ("numbers", "target"), "sudoku": ("puzzle",), "sudoku_cells": ("puzzle",)}
REWARD_CHOICES = {"sudoku": ("sudoku", "sudoku_cells")}  # a generator's reward kinds, its default first
OPTIONAL_FIELDS = ("tolerance",)  # the kind's fields that may be left out
COUNTDOWN_MAX_VALUE = 999  # the generator's targets and intermediate values stay in 1..999
_WANTED = {  # field: (accepted JSON types, what to give)
    "prompt": ((str,), "a string"), "answer": ((str,), "a string (quote a number: \"42\")"),
    "reward": ((str,), "a string"), "pattern": ((str,), "a string"), "tolerance": ((int, float), "a number >= 0"),
    "checker": ((str,), "a string (the path of a .py file)"), "numbers": ((list,), "a list of integers"),
    "target": ((int,), "an integer"), "puzzle": ((str,), "a string of 16 digits 0-4")}


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """One task: a prompt, its reference answer, and how a completion is rewarded (module docstring)."""

    prompt: str
    answer: str
    reward: str = "exact"
    pattern: Optional[str] = None
    tolerance: Optional[float] = None
    checker: Optional[str] = None
    numbers: Optional[Tuple[int, ...]] = None
    target: Optional[int] = None
    puzzle: Optional[str] = None

    def fields(self) -> Dict[str, Any]:
        """The task as a task file's line holds it and `rewards.score` takes it; unset fields left out."""
        return {name: list(value) if name == "numbers" else value
                for name, value in dataclasses.asdict(self).items() if value is not None}


# ------------------------------------------------------------------------------------ reading
def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _check_types(fields: Dict[str, Any], where: str) -> None:
    for name, value in fields.items():
        types, wanted = _WANTED[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise InputError(f"{where}: {name} is {_json_type(value)}; give {wanted}")
    if any(isinstance(number, bool) or not isinstance(number, int) for number in fields.get("numbers", [])):
        raise InputError(f"{where}: numbers {fields['numbers']!r} holds a non-integer; give a list of integers")


def _check_kind_fields(fields: Dict[str, Any], kind: str, where: str) -> None:
    """The kind's required fields are there, and no other kind's fields are."""
    for name in KIND_FIELDS[kind]:
        if name not in fields and name not in OPTIONAL_FIELDS:
            raise InputError(f"{where}: reward {kind!r} needs {name}; give {_WANTED[name][1]}")
    for name in fields:
        owners = [owner for owner, names in KIND_FIELDS.items() if name in names]
        if owners and kind not in owners:
            raise InputError(f"{where}: {name} applies only to reward {' or '.join(map(repr, owners))} and this "
                             f"task's reward is {kind!r}; drop {name}, or set \"reward\": \"{owners[0]}\"")


def _check_values(fields: Dict[str, Any], kind: str, where: str, folder: str) -> Dict[str, Any]:
    """The values' own rules; returns the fields with `checker` resolved and `tolerance` a float."""
    checked = dict(fields)
    if not fields["prompt"].strip():
        raise InputError(f"{where}: prompt is empty; give the question the model answers")
    if "pattern" in fields:
        try:
            re.compile(fields["pattern"])
        except re.error as error:
            raise InputError(f"{where}: pattern {fields['pattern']!r} does not compile ({error}); "
                             "fix the regular expression") from None
    if "tolerance" in fields:
        if not (math.isfinite(fields["tolerance"]) and fields["tolerance"] >= 0):
            raise InputError(f"{where}: tolerance {fields['tolerance']!r} is not a finite number >= 0; give one")
        checked["tolerance"] = float(fields["tolerance"])
    if kind == "numeric" and rewards.last_number(fields["answer"]) is None:
        raise InputError(f"{where}: answer {fields['answer']!r} holds no number, and reward 'numeric' "
                         "compares numbers; give the number")
    if "checker" in fields:
        checked["checker"] = _resolve_checker(fields["checker"], where, folder)
    if "numbers" in fields and not fields["numbers"]:
        raise InputError(f"{where}: numbers is an empty list; give the integers the expression must use")
    if "puzzle" in fields and not re.fullmatch(r"[0-4]{16}", fields["puzzle"]):
        raise InputError(f"{where}: puzzle {fields['puzzle']!r} is not 16 digits 0-4; give the 4x4 grid "
                         "row by row, 0 for a blank")
    if kind == "sudoku_cells" and not (re.fullmatch(r"[1-4]{16}", fields["answer"]) and all(
            given in ("0", cell) for given, cell in zip(fields["puzzle"], fields["answer"]))):
        raise InputError(f"{where}: answer {fields['answer']!r} is not a 16-digit solution (1-4) keeping the "
                         "puzzle's givens, which reward 'sudoku_cells' scores the blanks against; give it")
    return checked


def _resolve_checker(checker: str, where: str, folder: str) -> str:
    path = os.path.normpath(os.path.join(folder, os.path.expanduser(checker)))
    if not checker.endswith(".py"):
        raise InputError(f"{where}: checker {checker!r} is not a .py file; give the path of a Python file "
                         "defining reward(completion, answer, prompt)")
    if not os.path.isfile(path):
        raise InputError(f"{where}: checker {checker!r} does not exist (looked for {path}); give a path "
                         "relative to the task file's folder, or an absolute one")
    return path


def parse_record(fields: Any, where: str, folder: str = ".") -> TaskRecord:
    """The TaskRecord of one task file line's object, checked; `where` ("FILE:LINE") starts each
    InputError's message, and a relative `checker` is taken from `folder`."""
    if not isinstance(fields, dict):
        raise InputError(f"{where}: the line is {_json_type(fields)}, not an object; write each task as one "
                         "JSON object {\"prompt\": ..., \"answer\": ...}")
    unknown = [name for name in fields if name not in FIELDS]
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                         f"{', '.join(FIELDS)}")
    for name in ("prompt", "answer"):
        if name not in fields:
            raise InputError(f"{where}: missing {name}; every task needs \"{name}\", {_WANTED[name][1]}")
    _check_types(fields, where)
    kind = fields.get("reward", "exact")
    if kind not in REWARD_KINDS:
        raise InputError(f"{where}: reward {kind!r} is not one of {', '.join(REWARD_KINDS)}; use one of them")
    _check_kind_fields(fields, kind, where)
    checked = _check_values(fields, kind, where, folder)
    if "numbers" in checked:
        checked["numbers"] = tuple(checked["numbers"])
    checked["reward"] = kind
    return TaskRecord(**checked)


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            data = file.read()
        return gzip.decompress(data) if path.endswith(".gz") else data
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise InputError(f"{path}: not readable gzip data ({error}); give a complete .jsonl.gz, "
                         "or name a plain file .jsonl") from None
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; give the path of a .jsonl or .jsonl.gz task file") from None
    except OSError as error:  # a folder, no permission, ...
        raise InputError(f"{path}: cannot read it ({error.strerror}); give a readable .jsonl or .jsonl.gz "
                         "task file") from None


def load_tasks(path) -> List[TaskRecord]:
    """Every task of the JSON Lines file `path` (.jsonl, or .jsonl.gz), all checked before it returns;
    blank lines are skipped. Bad input raises InputError naming the file, the line and the fix."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    records = []
    for number, raw in enumerate(_read_bytes(path).split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{where}: not UTF-8 text; re-encode the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{where}: invalid JSON ({error.msg} at column {error.colno}); write each task "
                             "as one JSON object on one line") from None
        records.append(parse_record(fields, where, folder))
    if not records:
        raise InputError(f"{path}: no tasks (the file is empty); write one JSON object per line, "
                         "{\"prompt\": ..., \"answer\": ...}")
    return records


def write_tasks(records: Iterable[TaskRecord], path) -> int:
    """Writes `records` to `path` as a task file (write_json_lines); returns how many were written."""
    return write_json_lines([record.fields() for record in records], path)


def write_json_lines(rows: Iterable[Dict[str, Any]], path) -> int:
    """Writes `rows` to `path` as JSON Lines, gzipped when it ends in .gz, under a temporary name renamed
    into place (a process dying half-way leaves any earlier file whole); returns how many were written."""
    path = os.fspath(path)
    lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
    data = "".join(lines).encode("utf-8")
    if path.endswith(".gz"):
        data = gzip.compress(data, mtime=0)  # the same tasks, the same bytes
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return len(lines)


# ------------------------------------------------------------------------------------ generators
_ANSWER_FORMAT = "inside <answer></answer>"


def _combine(rng: random.Random, left: Tuple[int, str], right: Tuple[int, str]) -> Tuple[int, str]:
    """One random operation on two (value, expression) pairs whose value is a positive integer of at
    most COUNTDOWN_MAX_VALUE; the larger value goes first, so - and / stay positive and exact."""
    (a, first), (b, second) = sorted((left, right), key=lambda pair: -pair[0])
    options = []
    if a + b <= COUNTDOWN_MAX_VALUE:
        options.append(("+", a + b))
    if a > b:
        options.append(("-", a - b))
    if a * b <= COUNTDOWN_MAX_VALUE:
        options.append(("*", a * b))
    if b > 1 and a % b == 0:
        options.append(("/", a // b))
    symbol, value = rng.choice(options)  # never empty: a > b allows -, a == b allows / or (1 + 1)
    return value, f"({first} {symbol} {second})"


def countdown_task(rng: random.Random) -> TaskRecord:
    """3 or 4 numbers in 1..99 and a target that an expression of them all, each once, reaches."""
    numbers = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
    pool = [(number, str(number)) for number in numbers]
    while len(pool) > 1:
        first, second = rng.sample(range(len(pool)), 2)
        combined = _combine(rng, pool[first], pool[second])
        pool = [pair for index, pair in enumerate(pool) if index not in (first, second)] + [combined]
    target, expression = pool[0][0], pool[0][1][1:-1]
    prompt = (f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. Use each "
              "number exactly once, with + - * / and parentheses. Put only the expression (no '=' and no "
              f"result) {_ANSWER_FORMAT}.")
    return TaskRecord(prompt=prompt, answer=expression, reward="countdown", numbers=tuple(numbers), target=target)


def _line_order(rng: random.Random) -> List[int]:
    """A random order of 4 rows (or columns) that keeps each 2x2 band together."""
    return [2 * band + offset for band in rng.sample((0, 1), 2) for offset in rng.sample((0, 1), 2)]


def sudoku_solution(rng: random.Random) -> str:
    """A random solved 4x4 Sudoku, 16 digits row by row: a base grid with its digits relabelled, its
    rows and columns permuted within and across bands, and maybe transposed."""
    base = ((1, 2, 3, 4), (3, 4, 1, 2), (2, 1, 4, 3), (4, 3, 2, 1))
    digits = rng.sample((1, 2, 3, 4), 4)
    rows, cols = _line_order(rng), _line_order(rng)
    grid = [[digits[base[row][col] - 1] for col in cols] for row in rows]
    if rng.random() < 0.5:
        grid = [list(column) for column in zip(*grid)]
    return "".join(str(cell) for row in grid for cell in row)


def sudoku_task(rng: random.Random) -> TaskRecord:
    """A 4x4 Sudoku with 6 to 10 of its cells blank (0)."""
    solution = sudoku_solution(rng)
    blanks = set(rng.sample(range(16), rng.randint(6, 10)))
    puzzle = "".join("0" if index in blanks else cell for index, cell in enumerate(solution))
    prompt = ("Solve this 4x4 Sudoku: fill the blanks (0) so that every row, every column and every 2x2 box "
              f"holds each of the digits 1-4 once. The puzzle, 16 digits row by row: {puzzle}. Give the "
              f"16-digit solution, row by row, {_ANSWER_FORMAT}.")
    return TaskRecord(prompt=prompt, answer=solution, reward="sudoku", puzzle=puzzle)


def _operand(rng: random.Random) -> int:
    digits = rng.randint(3, 5)
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def arithmetic_task(rng: random.Random) -> TaskRecord:
    """The sum or the product of two 3- to 5-digit integers, checked exactly."""
    left, right, symbol = _operand(rng), _operand(rng), rng.choice("+*")
    value = left + right if symbol == "+" else left * right
    prompt = f"What is {left} {symbol} {right}? Give the integer {_ANSWER_FORMAT}."
    return TaskRecord(prompt=prompt, answer=str(value), reward="numeric", tolerance=0.0)


def addition_task(rng: random.Random) -> TaskRecord:
    """The sum of two 2- or 3-digit integers: a task a 135M model learns by fine-tuning, so decoding
    speed-ups can be weighed at a measurable accuracy (tools/benchmark/dlm_recipes.sh)."""
    left, right = (rng.randint(10, 999) for _ in range(2))
    prompt = f"What is {left} + {right}? Give the integer {_ANSWER_FORMAT}."
    return TaskRecord(prompt=prompt, answer=str(left + right), reward="numeric", tolerance=0.0)


GENERATORS: Dict[str, Callable[[random.Random], TaskRecord]] = {
    "countdown": countdown_task, "sudoku": sudoku_task, "arithmetic": arithmetic_task, "addition": addition_task}


def sft_record(record: TaskRecord) -> Dict[str, str]:
    """The chat record (prompt/response, tools/preprocess_data.py --chat) that teaches a task's format:
    the reference answer inside the answer tags its prompt asks for."""
    return {"prompt": record.prompt, "response": f"<answer>{record.answer}</answer>"}


def generate_tasks(kind: str, count: int, seed: int, reward: Optional[str] = None) -> List[TaskRecord]:
    """`count` tasks of `kind` (one of GENERATOR_KINDS), the same for the same seed; a private
    random.Random(seed) draws them, the global random state is left alone. `reward` picks another of
    the kind's reward kinds (REWARD_CHOICES: sudoku's partial credit) for the same tasks."""
    if kind not in GENERATORS:
        raise InputError(f"task kind {kind!r} is not one of {', '.join(GENERATOR_KINDS)}; use one of them")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise InputError(f"task count {count!r} is not an integer >= 0; give one")
    choices = REWARD_CHOICES.get(kind, ())
    if reward is not None and reward not in choices:
        raise InputError(f"reward {reward!r} does not apply to {kind} tasks; "
                         + (f"use one of {', '.join(choices)}" if choices else "leave it out"))
    rng = random.Random(seed)
    records = [GENERATORS[kind](rng) for _ in range(count)]
    return records if reward is None else [dataclasses.replace(record, reward=reward) for record in records]
