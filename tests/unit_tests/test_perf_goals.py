"""tools/benchmark/perf_goals.py on CPU (--smoke: a tiny model, two steps): the runs, the A/B
alternation, the time limits and the table. No speed is asserted."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "benchmark"))
import perf_goals  # noqa: E402


def test_the_arms_alternate_within_each_repeat():
    assert perf_goals.plan(["dlm", "7b"], ["A", "B"], 2) == [
        ("A", "dlm", 0), ("B", "dlm", 0), ("A", "dlm", 1), ("B", "dlm", 1),
        ("A", "7b", 0), ("B", "7b", 0), ("A", "7b", 1), ("B", "7b", 1)]


def test_a_smoke_run_gives_the_rows_and_the_table(tmp_path, capsys):
    """One real train_throughput.py process (tiny model, CPU) through the driver."""
    [record] = perf_goals.main(["--smoke", "--only", "dlm", "--out", str(tmp_path / "out")])
    assert "error" not in record, record
    assert [row["name"] for row in record["rows"]] == ["MegaDLMs masked-only exp-avg-bf16 exp-avg-sq-bf16"]
    assert record["rows"][0]["median_step_ms"] > 0
    assert "--masked-only-loss" in record["command"] and record["command"].count("--json") == 1
    assert "| dlm | MegaDLMs masked-only exp-avg-bf16 exp-avg-sq-bf16 | A | 1 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved[0]["rows"] == record["rows"]


def test_the_second_arm_runs_another_tree_with_its_extra_flags(tmp_path, monkeypatch, capsys):
    other = tmp_path / "other"
    (other / "tools" / "benchmark").mkdir(parents=True)
    (other / "tools" / "benchmark" / "train_throughput.py").write_text("")
    calls = []

    def fake_run(arm, tree, goal, argv, json_path, timeout):
        calls.append((arm, tree, goal, argv, timeout))
        row = {"name": "ours", "median_step_ms": 10.0 if arm == "A" else 9.0, "tflops_per_gpu": 1.0, "mfu": None,
               "peak_memory_gib": None}
        return {"arm": arm, "tree": tree, "goal": goal, "seconds": 0.0, "rows": [row]}

    monkeypatch.setattr(perf_goals, "run_one", fake_run)
    perf_goals.main(["--smoke", "--only", "dlm", "--ab-tree", str(other), "--ab-extra", "--seed 7", "--extra",
                     "--steps 3", "--repeats", "2", "--first-timeout", "99", "--out", str(tmp_path / "out")])
    assert [(arm, Path(tree).name) for arm, tree, *_ in calls] == [("A", ROOT.name), ("B", "other")] * 2
    assert all(argv[-2:] == ["--steps", "3"] for arm, _, _, argv, _ in calls if arm == "A")
    assert all(argv[-4:] == ["--steps", "3", "--seed", "7"] for arm, _, _, argv, _ in calls if arm == "B")
    assert [timeout for *_, timeout in calls] == [99, 240, 240, 240]  # only the first run compiles
    out = capsys.readouterr().out
    assert "| dlm | ours | A | 2 | 10.0 (10.0-10.0) |" in out and "| dlm | ours | B | 2 | 9.0 (9.0-9.0) |" in out


def test_a_run_past_its_limit_is_reported_not_fatal(tmp_path, capsys):
    records = perf_goals.main(["--smoke", "--only", "dlm", "--first-timeout", "0.5", "--out", str(tmp_path)])
    assert records[0]["error"] == "timed out after 0.5 s" and records[0]["rows"] == []
    assert "- dlm (A): timed out after 0.5 s" in capsys.readouterr().out


def test_a_failed_run_reports_its_last_log_line(tmp_path, capsys):
    """A run that exits non-zero is reported with the line that ended it (its error), not only the log."""
    records = perf_goals.main(["--smoke", "--only", "dlm", "--extra", "--micro-batch-size 0", "--out", str(tmp_path)])
    error = records[0]["error"]
    assert error.startswith("exit 2 (see ") and error.endswith("error: --micro-batch-size 0 must be at least 1"), error
    assert records[0]["rows"] == [] and "- dlm (A): exit 2" in capsys.readouterr().out


def test_bad_arguments_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="has no tools/benchmark/train_throughput.py"):
        perf_goals.main(["--ab-tree", str(tmp_path)])
    with pytest.raises(SystemExit, match="--repeats 0"):
        perf_goals.main(["--repeats", "0"])


def test_the_table_gives_the_rate_at_the_median_step_time():
    """Two runs of 10 and 12 ms (120 and 100 TFLOP/s, the same FLOPs): the median 11.0 ms is 109.1 TFLOP/s,
    not either run's rate."""
    records = [{"arm": "A", "goal": "dlm", "rows": [{"name": "ours", "median_step_ms": ms, "tflops_per_gpu": rate,
                                                      "mfu": rate / 1000, "peak_memory_gib": 1.0}]}
               for ms, rate in ((10.0, 120.0), (12.0, 100.0))]
    assert "| dlm | ours | A | 2 | 11.0 (10.0-12.0) | 109.1 | 10.9% | 1.0 |" in perf_goals.table(records)
