"""tools/benchmark/perf_goals.py on CPU (--smoke: a tiny model, two steps): the runs, the A/B
alternation, the time limits and the table. No speed is asserted."""

import json
import os
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


def test_a_smoke_run_against_another_tree_with_a_flag_gives_one_table(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    for part in ("megatron", "tools"):  # the same code as a second tree: the A/B plumbing, not a change
        os.symlink(ROOT / part, other / part)
    records = perf_goals.main(["--smoke", "--only", "dlm", "--ab-tree", str(other), "--ab-extra", "--seed 7",
                               "--out", str(tmp_path / "out")])
    assert [(r["arm"], Path(r["tree"]).name, r["goal"]) for r in records] == [("A", ROOT.name, "dlm"),
                                                                            ("B", "other", "dlm")]
    for record in records:
        assert "error" not in record, record
        assert [row["name"] for row in record["rows"]] == ["MegaDLMs masked-only exp-avg-bf16 exp-avg-sq-bf16"]
        assert all(row["median_step_ms"] > 0 for row in record["rows"])
        assert "--masked-only-loss" in record["command"] and record["command"].count("--json") == 1
    assert "--seed 7" not in records[0]["command"] and records[1]["command"].endswith(
        "--seed 7 --json " + str(tmp_path / "out" / "dlm_B_0.json"))
    out = capsys.readouterr().out
    assert "| dlm | MegaDLMs masked-only exp-avg-bf16 exp-avg-sq-bf16 | A | 1 |" in out
    assert "| dlm | MegaDLMs masked-only exp-avg-bf16 exp-avg-sq-bf16 | B | 1 |" in out
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["rows"] for r in saved] == [r["rows"] for r in records]


def test_a_run_past_its_limit_is_reported_not_fatal(tmp_path, capsys):
    records = perf_goals.main(["--smoke", "--only", "dlm", "--first-timeout", "0.5", "--out", str(tmp_path)])
    assert records[0]["error"] == "timed out after 0.5 s" and records[0]["rows"] == []
    assert "- dlm (A): timed out after 0.5 s" in capsys.readouterr().out


def test_bad_arguments_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="has no tools/benchmark/train_throughput.py"):
        perf_goals.main(["--ab-tree", str(tmp_path)])
    with pytest.raises(SystemExit, match="--repeats 0"):
        perf_goals.main(["--repeats", "0"])
