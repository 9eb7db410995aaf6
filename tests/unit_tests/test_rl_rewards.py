"""megatron/rl/rewards.py: answer extraction, each reward kind, and RewardWorkers (order kept, a hung,
raising or crashing checker scored 0.0, counted, and its worker replaced)."""

import ast
import os
import pathlib
import sys
import time

import pytest

from megatron.rl import rewards
from megatron.rl.tasks import REWARD_KINDS, TaskRecord

REWARDS_PY = pathlib.Path(rewards.__file__)


def test_rewards_imports_only_the_standard_library():
    """Worker processes import this module: it must start without torch or the project's packages."""
    tree = ast.parse(REWARDS_PY.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)


def test_every_reward_kind_has_a_scorer():
    assert set(rewards.SCORERS) == set(REWARD_KINDS)


# ------------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize("completion, expected", [
    ("I think <answer> 12 </answer> no wait <answer>\n 13\n</answer> done", "13"),  # the last tag
    ("<answer>a\nb</answer>", "a\nb"),  # across lines
    ("so \\boxed{\\frac{1}{2}} and \\boxed{x^{2}}.", "x^{2}"),  # the last box, braces balanced
    ("\\boxed{7} then \\boxed{8", "7"),  # an unclosed last box falls back to the one before
    ("<answer>5</answer> \\boxed{6}", "5"),  # tags first
    ("Step 1\nStep 2\n  the answer is 42  \n\n  \n", "the answer is 42"),  # the last non-empty line
    ("", ""),
    ("<answer></answer>", ""),
])
def test_extract_answer(completion, expected):
    assert rewards.extract_answer(completion) == expected


def test_extract_answer_on_many_unclosed_boxes_is_quick():
    start = time.monotonic()
    assert rewards.extract_answer("\\boxed{" * 20000 + "end") == "\\boxed{" * 20000 + "end"
    assert time.monotonic() - start < 1.0


# ------------------------------------------------------------------------------------ the kinds
def test_exact_collapses_whitespace():
    fields = {"prompt": "p", "answer": " New  York\tCity "}
    assert rewards.score(fields, "<answer>New York   City</answer>") == 1.0
    assert rewards.score(fields, "<answer>new york city</answer>") == 0.0
    assert rewards.score(fields, None) == 0.0


def test_numeric_tolerance_edge():
    fields = {"prompt": "p", "answer": "1000", "reward": "numeric", "tolerance": 0.01}
    assert rewards.score(fields, "<answer>1010</answer>") == 1.0  # |x - y| = 10 = 0.01 * 1000: in
    assert rewards.score(fields, "<answer>1010.001</answer>") == 0.0  # just out
    assert rewards.score(fields, "<answer>990</answer>") == 1.0
    assert rewards.score(fields, "so x = 1,005 apples") == 1.0  # the last number, commas removed
    assert rewards.score(fields, "<answer>999 then 2000</answer>") == 0.0  # the last number counts
    assert rewards.score(fields, "<answer>no number</answer>") == 0.0
    small = {"prompt": "p", "answer": "0.5", "reward": "numeric", "tolerance": 0.01}
    assert rewards.score(small, "<answer>0.51</answer>") == 1.0  # floored at absolute 0.01 for |y| < 1
    assert rewards.score(small, "<answer>0.52</answer>") == 0.0
    default = {"prompt": "p", "answer": "3.14159", "reward": "numeric"}
    assert rewards.score(default, "<answer>3.1416</answer>") == 0.0  # 1e-6 relative by default: 1e-5 is out
    assert rewards.score(default, "<answer>3.141593</answer>") == 1.0  # 3e-6 <= 3.14159e-6 is in
    exact = {"prompt": "p", "answer": "123456789123456789", "reward": "numeric", "tolerance": 0}
    assert rewards.score(exact, "<answer>123456789123456789</answer>") == 1.0
    assert rewards.score(exact, "<answer>123456789123456788</answer>") == 0.0  # exact, not float
    assert rewards.score(exact, "<answer>" + "9" * 5000 + "</answer>") == 0.0  # over the int-digits limit


def test_regex_matches_the_whole_answer():
    fields = {"prompt": "p", "answer": "x", "reward": "regex", "pattern": r"[A-E](, [A-E])*"}
    assert rewards.score(fields, "<answer>A, C</answer>") == 1.0
    assert rewards.score(fields, "<answer>A, C and F</answer>") == 0.0
    assert rewards.score(fields, "<answer>a</answer>") == 0.0


def write_checker(folder, name, body):
    path = folder / name
    path.write_text(body)
    return str(path)


def test_python_checker_is_clipped_and_gets_the_whole_completion(tmp_path):
    body = ("def reward(completion, answer, prompt):\n"
            "    if prompt != 'Q':\n        return -1.0\n"
            "    return 5.0 if answer in completion else float(completion.count('x')) / 4\n")
    fields = {"prompt": "Q", "answer": "yes", "reward": "python", "checker": write_checker(tmp_path, "c.py", body)}
    assert rewards.score(fields, "oh yes") == 1.0  # clipped from 5.0
    assert rewards.score(fields, "xx") == 0.5
    assert rewards.score(dict(fields, prompt="other"), "yes") == 0.0  # clipped from -1.0


# ------------------------------------------------------------------------------------ workers
HANG = "import time\ndef reward(completion, answer, prompt):\n    time.sleep(3600)\n"
RAISE = "def reward(completion, answer, prompt):\n    raise RuntimeError('checker bug')\n"
CRASH = "import os\ndef reward(completion, answer, prompt):\n    os._exit(3)\n"


def exact(answer):
    return {"prompt": "p", "answer": answer}


def test_workers_keep_the_order():
    pairs = [(exact(str(index % 3)), f"<answer>{index % 2}</answer>") for index in range(40)]
    pairs.append((TaskRecord(prompt="p", answer="408", reward="numeric", tolerance=0.0), "<answer>408</answer>"))
    with rewards.RewardWorkers(num_workers=3, timeout_s=5.0) as workers:
        got = workers.score(pairs)
        assert workers.score([]) == []
    assert got == [rewards.score(rewards.as_fields(record), completion) for record, completion in pairs]
    assert got[-1] == 1.0 and 0.0 in got and got.count(1.0) > 10
    assert (workers.timeouts, workers.errors) == (0, 0)
    assert workers.pids == []
    with pytest.raises(RuntimeError, match="after close"):
        workers.score(pairs)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hung_checker_times_out_and_the_workers_go_on(tmp_path):
    hang = {"prompt": "p", "answer": "a", "reward": "python", "checker": write_checker(tmp_path, "hang.py", HANG)}
    with rewards.RewardWorkers(num_workers=1, timeout_s=1.0) as workers:
        [stuck] = workers.pids
        start = time.monotonic()
        got = workers.score([(exact("4"), "<answer>4</answer>"), (hang, "x"), (exact("5"), "<answer>5</answer>")])
        elapsed = time.monotonic() - start
        assert got == [1.0, 0.0, 1.0]
        assert elapsed < 1.0 + 2.0, elapsed
        assert (workers.timeouts, workers.errors) == (1, 0) and "ran past 1 s" in workers.last_error
        assert workers.pids != [stuck] and not alive(stuck), "the stuck worker was not ended"
        assert workers.score([(exact("6"), "<answer>6</answer>")]) == [1.0]
        [replacement] = workers.pids
    assert workers.pids == [] and not alive(replacement)


def test_a_raising_or_crashing_checker_scores_zero_and_is_counted(tmp_path):
    raising = {"prompt": "p", "answer": "a", "reward": "python", "checker": write_checker(tmp_path, "r.py", RAISE)}
    crashing = {"prompt": "p", "answer": "a", "reward": "python", "checker": write_checker(tmp_path, "x.py", CRASH)}
    with rewards.RewardWorkers(num_workers=2, timeout_s=5.0) as workers:
        got = workers.score([(raising, "a"), (exact("1"), "1"), (crashing, "a"), (exact("2"), "<answer>2</answer>")])
        assert got == [0.0, 1.0, 0.0, 1.0]
        assert (workers.timeouts, workers.errors) == (0, 2)
        assert workers.score([(exact("3"), "3"), (raising, "a")]) == [1.0, 0.0]
        assert workers.errors == 3 and "RuntimeError: checker bug" in workers.last_error
