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


def test_the_trees_alternate_within_each_repeat():
    assert perf_goals.plan(["dlm", "7b"], ["new", "old"], 2) == [
        ("new", "dlm", 0), ("old", "dlm", 0), ("new", "dlm", 1), ("old", "dlm", 1),
        ("new", "7b", 0), ("old", "7b", 0), ("new", "7b", 1), ("old", "7b", 1)]


def test_a_smoke_run_against_another_tree_gives_one_table(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    for part in ("megatron", "tools"):  # the same code as a second tree: the A/B plumbing, not a change
        os.symlink(ROOT / part, other / part)
    records = perf_goals.main(["--smoke", "--only", "dlm", "--ab-tree", str(other), "--out", str(tmp_path / "out")])
    assert [(Path(r["tree"]).name, r["goal"]) for r in records] == [(ROOT.name, "dlm"), ("other", "dlm")]
    for record in records:
        assert "error" not in record, record
        assert [row["name"] for row in record["rows"]] == ["MegaDLMs masked-only exp-avg-bf16 exp-avg-sq-bf16"]
        assert all(row["median_step_ms"] > 0 for row in record["rows"])
        assert "--masked-only-loss" in record["command"] and record["command"].count("--json") == 1
    out = capsys.readouterr().out
    assert out.count("| dlm | MegaDLMs masked-only exp-avg-bf16 exp-avg-sq-bf16 |") == 2
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["rows"] for r in saved] == [r["rows"] for r in records]


def test_a_run_past_its_limit_is_reported_not_fatal(tmp_path, capsys):
    records = perf_goals.main(["--smoke", "--only", "dlm", "--first-timeout", "0.5", "--out", str(tmp_path)])
    assert records[0]["error"] == "timed out after 0.5 s" and records[0]["rows"] == []
    assert "dlm from .: timed out after 0.5 s" in capsys.readouterr().out


def test_bad_arguments_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="has no tools/benchmark/train_throughput.py"):
        perf_goals.main(["--ab-tree", str(tmp_path)])
    with pytest.raises(SystemExit, match="--repeats 0"):
        perf_goals.main(["--repeats", "0"])
