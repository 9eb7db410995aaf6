"""tools/benchmark/lm_eval_throughput.py on CPU at the tiny shape: the table, the JSON it writes
(totals, medians over the parts, the levers, the padding count) and a bad flag. No speed is asserted."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "benchmark"))
import lm_eval_throughput as bench  # noqa: E402

TINY = ["--model", "tiny", "--questions", "4", "--choices", "2", "--context-tokens", "4", "12", "--answer-tokens",
        "1", "4", "--mc-num", "4", "--batch-size", "8", "--loop-batch-size", "2"]


def test_benchmark_times_both_scorers_and_the_levers(tmp_path, capsys):
    out = tmp_path / "lm.json"
    result = bench.main([*TINY, "--loop-questions", "2", "--repeats", "2", "--lever-questions", "2",
                         "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    table = capsys.readouterr().out
    assert "| batched (ours) | 8 | 4 |" in table and "| one pair at a time (LLaDA) | 2 | 2 |" in table
    assert "levers on 2 questions" in table
    ours, loop = result["batched"], result["loop"]
    assert (ours["questions"], loop["questions"]) == (4, 2)
    assert len(ours["parts_questions_per_s"]) == len(loop["parts_questions_per_s"]) == 2
    assert result["speedup"] == pytest.approx(ours["questions_per_s"] / loop["questions_per_s"])
    assert ours["seconds"] > 0 and math.isfinite(result["median_speedup"])
    assert 0 <= result["relative_difference_of_the_estimates"] < 0.5  # the same estimator, other draws
    assert 0 <= result["padding"]["sorted"] <= result["padding"]["unsorted"] < 1
    assert result["levers"]["questions"] == 2 and result["levers"]["select_speedup"] > 0
    assert result["levers"]["dedupe_speedup"] > 0 and "equal masked copies once" in table
    assert 0 < result["distinct_tokens"] < 1  # answers of 1-4 tokens, 4 copies: some masks repeat


def test_a_bad_count_is_one_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*TINY, "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats must be at least 1" in capsys.readouterr().err
