"""megatron/rl/tasks.py and tools/build_rl_task.py: the generators (deterministic in the seed, each
task's own answer scoring 1.0), the task file's checks (one-line errors naming file, line and fix),
the write/load round trip, and the CLI."""

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.core.errors import InputError
from megatron.rl import rewards, tasks
from megatron.rl.tasks import TaskRecord

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ generators
@pytest.mark.parametrize("kind", tasks.GENERATOR_KINDS)
def test_generators_are_deterministic_in_the_seed_and_leave_the_global_rng_alone(kind):
    state = random.getstate()
    first = tasks.generate_tasks(kind, 20, seed=7)
    assert random.getstate() == state, "the generator drew from the global random state"
    assert tasks.generate_tasks(kind, 20, seed=7) == first
    assert tasks.generate_tasks(kind, 20, seed=8) != first
    assert len(first) == 20 and len({record.prompt for record in first}) > 10


@pytest.mark.parametrize("kind", tasks.GENERATOR_KINDS)
def test_every_generated_task_is_solved_by_its_own_answer(kind):
    for record in tasks.generate_tasks(kind, 200, seed=1):
        fields = record.fields()
        assert rewards.score(fields, f"Let me think.\n<answer>{record.answer}</answer>") == 1.0, record
        assert rewards.score(fields, record.answer) == 1.0, record  # the last line, no tags
        assert rewards.score(fields, "<answer>no idea</answer>") == 0.0, record


def test_countdown_tasks_follow_the_rules():
    for record in tasks.generate_tasks("countdown", 300, seed=3):
        assert record.reward == "countdown" and len(record.numbers) in (3, 4)
        assert all(1 <= number <= 99 for number in record.numbers)
        assert isinstance(record.target, int) and 1 <= record.target <= tasks.COUNTDOWN_MAX_VALUE
        assert str(list(record.numbers)) in record.prompt and str(record.target) in record.prompt
        assert "<answer></answer>" in record.prompt


def test_countdown_rejects_reuse_names_calls_and_other_values():
    record = TaskRecord(prompt="p", answer="(98 - 73) * 9", reward="countdown", numbers=(73, 98, 9), target=225)
    fields = record.fields()
    assert rewards.score(fields, "<answer>(98 - 73) * 9</answer>") == 1.0
    assert rewards.score(fields, "<answer>9 * (98 - 73)</answer>") == 1.0
    wrong = ["(98 - 73) * 9 * 9 / 9",  # 9 used three times: the value is right, the numbers are not
             "(98 - 73) * 9 + 73 - 73",  # 73 reused
             "(98 - 73) * 9 + 0",  # a number not in the list
             "(98 - 73) * 9 = 225",  # not an expression
             "__import__('os').system('true') or 225",  # a name and a call
             "abs(98 - 73) * 9",  # a call
             "(98 + 73) * 9",  # another value
             "(98 - 73) ** 9",  # another operator
             "98.0 - 73 * 9",  # a float
             "9 / (98 - 98) + 73",  # division by zero
             "(" * 500 + "9" + ")" * 500,  # too deep to parse
             ""]
    for completion in wrong:
        assert rewards.score(fields, f"<answer>{completion}</answer>") == 0.0, completion


def test_sudoku_tasks_are_valid_and_wrong_grids_score_zero():
    for record in tasks.generate_tasks("sudoku", 200, seed=5):
        assert rewards.is_sudoku_solution(record.answer), record.answer
        blanks = record.puzzle.count("0")
        assert 6 <= blanks <= 10 and record.puzzle in record.prompt
        assert all(given in ("0", cell) for given, cell in zip(record.puzzle, record.answer))
    record = TaskRecord(prompt="p", answer="1234341221434321", reward="sudoku", puzzle="1034300221004301")
    fields = record.fields()
    assert rewards.score(fields, "<answer>1234 3412 2143 4321</answer>") == 1.0  # rows may be spaced
    swapped_rows = "3412123421434321"  # the first two rows swapped: a solution, but not of this puzzle
    assert rewards.is_sudoku_solution(swapped_rows)
    assert rewards.score(fields, f"<answer>{swapped_rows}</answer>") == 0.0, "changes the given 1 of cell 0"
    bad_box = "1234234134124123"  # a cyclic Latin square: rows and columns fine, the top-left box holds 1, 2, 2, 3
    assert all(sorted(bad_box[4 * row:4 * row + 4]) == list("1234") for row in range(4))
    assert all(sorted(bad_box[col::4]) == list("1234") for col in range(4))
    assert not rewards.is_sudoku_solution(bad_box)
    open_fields = dict(fields, puzzle="0" * 16)
    assert rewards.score(open_fields, f"<answer>{bad_box}</answer>") == 0.0
    assert rewards.score(open_fields, "<answer>123434122143432</answer>") == 0.0  # 15 digits
    assert rewards.score(open_fields, "<answer>1234341221434325</answer>") == 0.0  # a 5


def test_sudoku_cells_scores_the_share_of_blanks_filled_right():
    """d1's partial credit: each blank is compared with the reference answer's digit; any solution keeping
    the givens scores 1.0, a grid in another layout is read by its digits."""
    fields = TaskRecord(prompt="p", answer="1234341221434321", reward="sudoku_cells",
                        puzzle="1034300221004301").fields()  # blanks at cells 1, 5, 6, 10, 11, 14
    assert rewards.score(fields, "<answer>1234341221434321</answer>") == 1.0
    assert rewards.score(fields, "<answer>1234 3412 2143 4321</answer>") == 1.0
    assert rewards.score(fields, "<answer>2234341221434321</answer>") == 1.0  # given 0 changed: blanks only count
    two_wrong = "1434321221434321"  # blanks 1 (2 -> 4) and 5 (4 -> 2) wrong
    assert rewards.score(fields, f"<answer>{two_wrong}</answer>") == pytest.approx(4 / 6)
    assert rewards.score(fields, "<answer>1234</answer>") == pytest.approx(1 / 6)  # cells 0-3: blank 1 right
    assert rewards.score(fields, "no answer") == 0.0
    assert rewards.score(dict(fields, reward="sudoku"), f"<answer>{two_wrong}</answer>") == 0.0
    open_fields = dict(fields, puzzle="0" * 16, answer="1234341221434321")
    assert rewards.score(open_fields, "<answer>3412123421434321</answer>") == 1.0  # another solution
    records = tasks.generate_tasks("sudoku", 5, seed=3, reward="sudoku_cells")
    assert [dataclasses.replace(r, reward="sudoku") for r in records] == tasks.generate_tasks("sudoku", 5, seed=3)
    with pytest.raises(InputError, match="reward 'sudoku_cells' does not apply to countdown tasks; leave it out"):
        tasks.generate_tasks("countdown", 2, seed=3, reward="sudoku_cells")


def test_arithmetic_tasks_are_exact():
    for record in tasks.generate_tasks("arithmetic", 200, seed=9):
        assert record.reward == "numeric" and record.tolerance == 0.0
        left, symbol, right = record.prompt.split("What is ")[1].split("?")[0].split()
        assert 100 <= int(left) <= 99999 and 100 <= int(right) <= 99999
        assert int(record.answer) == (int(left) + int(right) if symbol == "+" else int(left) * int(right))
        assert rewards.score(record.fields(), f"<answer>{int(record.answer) + 1}</answer>") == 0.0
        assert rewards.score(record.fields(), f"<answer>{int(record.answer):,}</answer>") == 1.0


def test_generate_tasks_rejects_unknown_kinds():
    with pytest.raises(InputError, match="'chess' is not one of countdown, sudoku, arithmetic"):
        tasks.generate_tasks("chess", 3, seed=0)


# ------------------------------------------------------------------------------------ the task file
def write_lines(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"prompt": "2 + 2?", "answer": "4"})


@pytest.mark.parametrize("bad_line, expected", [
    ('{"prompt": "2 + 2?", "answer": "4"', "invalid JSON"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "exactt"}),
     "reward 'exactt' is not one of exact, regex, numeric, python, countdown, sudoku, sudoku_cells; use one"),
    (json.dumps({"answer": "4"}), "missing prompt"),
    (json.dumps({"prompt": "p", "answer": "4", "hint": "x", "level": 2}), "unknown key(s) 'hint', 'level'"),
    (json.dumps({"prompt": "p", "answer": 4}), "answer is a number; give a string"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "regex"}), "reward 'regex' needs pattern"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "regex", "pattern": "4("}), "pattern '4(' does not compile"),
    (json.dumps({"prompt": "p", "answer": "4", "tolerance": 0.1}), "tolerance applies only to reward 'numeric'"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "numeric", "tolerance": -1}), "tolerance -1 is not"),
    (json.dumps({"prompt": "p", "answer": "four", "reward": "numeric"}), "holds no number"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "python", "checker": "missing.py"}),
     "checker 'missing.py' does not exist"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "countdown", "numbers": [1, 3]}), "needs target"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "countdown", "numbers": [1, "3"], "target": 4}),
     "holds a non-integer"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "sudoku", "puzzle": "123"}), "not 16 digits 0-4"),
    (json.dumps({"prompt": "p", "answer": "4", "puzzle": "0" * 16}),
     "puzzle applies only to reward 'sudoku' or 'sudoku_cells' and this task's reward is 'exact'"),
    (json.dumps({"prompt": "p", "answer": "4", "reward": "sudoku_cells", "puzzle": "0" * 16}),
     "answer '4' is not a 16-digit solution"),
    (json.dumps({"prompt": "p", "answer": "1234341221434321", "reward": "sudoku_cells", "puzzle": "2" + "0" * 15}),
     "keeping the puzzle's givens"),
    ("[1, 2]", "the line is a list, not an object"),
])
def test_load_tasks_names_the_file_the_line_and_the_fix(tmp_path, bad_line, expected):
    path = write_lines(tmp_path / "tasks.jsonl", GOOD, "", GOOD, bad_line, GOOD)
    with pytest.raises(InputError) as caught:
        tasks.load_tasks(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}:4: "), message
    assert expected in message and "; " in message, message


def test_load_tasks_rejects_an_empty_or_missing_file(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", "", "  ")
    with pytest.raises(InputError, match=r"empty\.jsonl: no tasks \(the file is empty\); write one JSON object"):
        tasks.load_tasks(empty)
    with pytest.raises(InputError, match="no such file"):
        tasks.load_tasks(tmp_path / "absent.jsonl")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(InputError, match="not readable gzip data"):
        tasks.load_tasks(broken)


def test_a_checker_path_is_taken_from_the_task_files_folder(tmp_path):
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "check.py").write_text("def reward(completion, answer, prompt):\n    return 1.0\n")
    line = json.dumps({"prompt": "p", "answer": "a", "reward": "python", "checker": "checks/check.py"})
    [record] = tasks.load_tasks(write_lines(tmp_path / "tasks.jsonl", line))
    assert record.checker == str(tmp_path / "checks" / "check.py")
    assert rewards.score(record.fields(), "anything") == 1.0


@pytest.mark.parametrize("name", ["tasks.jsonl", "tasks.jsonl.gz"])
def test_write_then_load_gives_the_same_records(tmp_path, name):
    checker = tmp_path / "check.py"
    checker.write_text("def reward(completion, answer, prompt):\n    return 0.5\n")
    records = [record for kind in tasks.GENERATOR_KINDS for record in tasks.generate_tasks(kind, 5, seed=2)]
    records += [TaskRecord(prompt="Name a prime.", answer="7", reward="regex", pattern=r"\d+"),
                TaskRecord(prompt="π to 2 places? «ü»", answer="3.14", reward="numeric", tolerance=0.01),
                TaskRecord(prompt="p", answer="a", reward="python", checker=str(checker)),
                TaskRecord(prompt="Say hi.", answer="hi")]
    assert tasks.write_tasks(records, tmp_path / name) == len(records)
    assert tasks.load_tasks(tmp_path / name) == records
    assert not [path for path in tmp_path.iterdir() if ".tmp-" in path.name]


# ------------------------------------------------------------------------------------ the CLI
def run_cli(*args):
    return subprocess.run([sys.executable, "tools/build_rl_task.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_cli_writes_tasks_and_refuses_to_overwrite(tmp_path):
    output = tmp_path / "countdown.jsonl.gz"
    done = run_cli("--kind", "countdown", "--count", 12, "--seed", 4, "--output", output)
    assert done.returncode == 0, done.stderr
    assert tasks.load_tasks(output) == tasks.generate_tasks("countdown", 12, seed=4)
    written = output.read_bytes()
    refused = run_cli("--kind", "sudoku", "--count", 3, "--seed", 4, "--output", output)
    assert refused.returncode == 2 and output.read_bytes() == written
    assert refused.stderr.count("\n") == 1 and "exists; pass --force" in refused.stderr, refused.stderr
    forced = run_cli("--kind", "sudoku", "--count", 3, "--seed", 4, "--output", output, "--force")
    assert forced.returncode == 0, forced.stderr
    assert [record.reward for record in tasks.load_tasks(output)] == ["sudoku"] * 3
    cells = run_cli("--kind", "sudoku", "--count", 3, "--seed", 4, "--output", output, "--force",
                    "--reward", "sudoku_cells")
    assert cells.returncode == 0 and "reward sudoku_cells" in cells.stdout, cells.stderr
    assert [record.reward for record in tasks.load_tasks(output)] == ["sudoku_cells"] * 3
    wrong = run_cli("--kind", "countdown", "--count", 3, "--seed", 4, "--output", output, "--force",
                    "--reward", "sudoku")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "does not apply to countdown" in wrong.stderr


def test_addition_tasks_score_their_answer_and_become_chat_records(tmp_path):
    import gzip

    from tools import build_rl_task

    records = tasks.generate_tasks("addition", 20, seed=3)
    for record in records:
        left, right = (int(part) for part in record.prompt.split("What is ")[1].split("?")[0].split(" + "))
        assert int(record.answer) == left + right and 10 <= left <= 999 and 10 <= right <= 999
        chat = tasks.sft_record(record)
        assert rewards.score(record.fields(), chat["response"]) == 1.0
        assert rewards.score(record.fields(), f"<answer>{left + right + 1}</answer>") == 0.0
    out = tmp_path / "addition_sft.jsonl.gz"
    assert build_rl_task.main(["--kind", "addition", "--count", "5", "--seed", "3", "--output", str(out), "--sft"]) == 0
    with gzip.open(out, "rt") as lines:
        written = [json.loads(line) for line in lines]
    assert written == [tasks.sft_record(record) for record in records[:5]]
