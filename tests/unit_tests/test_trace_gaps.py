"""tools/benchmark/trace_gaps.py on a hand-made trace: which idle intervals it finds and whom it blames."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools", "benchmark"))
import trace_gaps  # noqa: E402


def _kernel(ts, dur, name, correlation=None):
    return {"cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"correlation": correlation}}


def _trace():
    """Kernels busy 0-20, 50-80 (two overlapping streams), 200-210; the 200 one launched in aten::mm."""
    return [
        _kernel(0, 10, "a"), _kernel(10, 10, "b"),
        _kernel(50, 20, "c", correlation=3), {"cat": "gpu_memset", "ts": 60, "dur": 20, "name": "Memset"},
        _kernel(200, 10, "gemm", correlation=7),
        {"cat": "cuda_runtime", "ts": 45, "dur": 2, "name": "cudaLaunchKernel", "tid": 1, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "ts": 190, "dur": 3, "name": "cuLaunchKernelEx", "tid": 1,
         "args": {"correlation": 7}},
        {"cat": "cuda_runtime", "ts": 20, "dur": 25, "name": "cudaStreamSynchronize", "tid": 1, "args": {}},
        {"cat": "cpu_op", "ts": 100, "dur": 100, "name": "_LinearCrossEntropy", "tid": 1},
        {"cat": "cpu_op", "ts": 150, "dur": 45, "name": "aten::mm", "tid": 1},
        {"cat": "cpu_op", "ts": 150, "dur": 45, "name": "other thread's op", "tid": 2},
        {"ph": "M", "name": "process_name"},  # metadata without a duration is ignored
    ]


def test_gaps_are_the_idle_intervals_between_merged_device_intervals():
    summary = trace_gaps.summarize(_trace(), min_us=20, top=5, steps=2)
    # busy [0, 20], [50, 80] (the memset overlaps kernel c), [200, 210]: gaps of 30 and 120 us
    assert summary["gaps"] == 2
    assert summary["gap_ms"] == pytest.approx(0.150)
    assert summary["span_ms"] == pytest.approx(0.210)
    first, second = summary["largest"]
    assert (first["ms"], first["next"]) == (pytest.approx(0.120), "gemm")
    assert first["launched_in"] == "_LinearCrossEntropy > aten::mm"  # the launch's own thread only
    assert second["next"] == "c" and second["launched_in"] == "(no op open)"
    assert summary["sync_ms"] == {"cudaStreamSynchronize": pytest.approx(0.025)}
    text = trace_gaps.format_summary(summary)
    assert "2, 0.15 ms (0.07 ms a step)" in text and "launched in _LinearCrossEntropy > aten::mm" in text


def test_short_intervals_are_not_gaps():
    assert trace_gaps.summarize(_trace(), min_us=200)["gaps"] == 0
    assert trace_gaps.summarize(_trace(), min_us=29)["gaps"] == 2


def test_the_command_reads_a_gzipped_trace_in_a_directory(tmp_path, capsys):
    with gzip.open(tmp_path / "step.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": _trace()}, handle)
    summary = trace_gaps.main([str(tmp_path), "--min-us", "20", "--steps", "2"])
    assert summary["gaps"] == 2
    assert "0.120 ms before 'gemm'" in capsys.readouterr().out


def test_unreadable_inputs_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="0 traces found"):
        trace_gaps.load_events(str(tmp_path))
    cpu_only = [e for e in _trace() if e.get("cat") == "cpu_op"]
    with pytest.raises(SystemExit, match="no device events"):
        trace_gaps.summarize(cpu_only)
