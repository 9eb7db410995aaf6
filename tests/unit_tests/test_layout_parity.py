"""tools/benchmark/layout_parity.py: layout names, the flags and GPUs they mean, the log it reads, and one
run on CPU (gloo) of a one-process, a data-parallel and a pipelined layout of a tiny launch script, whose
losses must agree. No speed is asserted."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "benchmark"))
import layout_parity  # noqa: E402


@pytest.mark.parametrize("name,sizes,gpus", [
    ("1gpu", {}, 1), ("dp2", {"dp": 2}, 2), ("tp2sp", {"tp": 2, "sequence_parallel": True}, 2),
    ("pp4v2", {"pp": 4, "virtual": 2}, 4), ("tp2pp2dp2", {"tp": 2, "pp": 2, "dp": 2}, 8),
    ("cp2dp2ep4", {"cp": 2, "dp": 2, "ep": 4}, 4), ("ep4dp4", {"ep": 4, "dp": 4}, 4)])
def test_a_layout_name_gives_its_sizes_and_gpus(name, sizes, gpus):
    layout = layout_parity.parse_layout(name)
    assert layout == layout_parity.Layout(name, **sizes) and layout.gpus == gpus


def test_the_flags_of_a_layout():
    def sizes(tp, pp, cp, ep):
        return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                "--context-parallel-size", str(cp), "--expert-model-parallel-size", str(ep)]
    assert layout_parity.parse_layout("tp2sppp2v2").flags() == sizes(2, 2, 1, 1) + [
        "--num-virtual-stages-per-pipeline-rank", "2", "--sequence-parallel", "--timing-log-level", "2"]
    # every size is given, 1 included: a script's own layout gives way
    assert layout_parity.parse_layout("ep4dp4").flags() == sizes(1, 1, 1, 4)
    assert layout_parity.parse_layout("1gpu").flags() == sizes(1, 1, 1, 1)
    # 16 sequences, micro-batch 2, dp 2: 4 micro-batches per replica
    assert layout_parity.parse_layout("pp2dp2").bubble_formula(16, 2) == pytest.approx(1 / 5)
    assert layout_parity.parse_layout("pp4v2").bubble_formula(16, 2) == pytest.approx(3 / 19)
    assert layout_parity.parse_layout("dp2").bubble_formula(16, 2) is None


@pytest.mark.parametrize("name,message", [("tp2x", "use sizes such as"), ("dp2dp2", "names dp twice"),
                                          ("v2", "need a pipeline"), ("sp", "needs tensor parallelism"),
                                          ("ep4dp2", "must divide dp x cp"), ("tp0", ">= 1"), ("", "use sizes")])
def test_a_bad_layout_name_says_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=message):
        layout_parity.parse_layout(name)


def test_a_bad_layout_is_a_usage_error_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        layout_parity.main(["--script", "examples/dlm_training/dlm_pretrain_1.7b.sh", "--layouts", "1gpu", "tq2",
                            "--log-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "'tq2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layout_parity.main(["--script", "examples/dlm_training/dlm_pretrain_1.7b.sh", "--layouts", "dp2",
                            "--global-batch-size", "3", "--log-dir", str(tmp_path)])
    assert "must be a multiple of --micro-batch-size x dp" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing ran"


def test_check_only_validates_each_layout_and_launches_nothing(tmp_path, capsys):
    """--check-only: the launch script's flags checked for each layout's ranks (CHECK_ONLY=1), a layout
    they do not fit named with the check's line and a non-zero exit, and no run started (no logs)."""
    argv = ["--script", "examples/dlm_training/dlm_pretrain_1.7b.sh", "--global-batch-size", "16", "--extra",
            "--num-layers 12", "--log-dir", str(tmp_path / "logs"), "--check-only", "--layouts"]
    assert layout_parity.main(argv + ["1gpu", "pp2v2", "tp2sppp2dp2"]) == {}
    assert capsys.readouterr().out.splitlines() == [f"{name}: the flags hold" for name in ("1gpu", "pp2v2",
                                                                                            "tp2sppp2dp2")]
    with pytest.raises(SystemExit) as exit_info:
        layout_parity.main(argv + ["pp2", "pp4v2"])
    lines = capsys.readouterr().out.splitlines()
    assert exit_info.value.code == 1 and lines[0] == "pp2: the flags hold"
    assert lines[1].startswith("pp4v2: ") and "--num-layers 12" in lines[1]
    assert not (tmp_path / "logs").exists()


TINY_SCRIPT = """#!/usr/bin/env bash
RUN_NAME=tiny
source "{root}/examples/launch_common.sh"
run_pretrain --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 \\
    --max-position-embeddings 32 --normalization RMSNorm --swiglu --disable-bias-linear \\
    --attention-dropout 0.0 --hidden-dropout 0.0 \\
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$TRAIN_ITERS" \\
    --lr 1e-3 --lr-warmup-iters "$LR_WARMUP_ITERS" --model-running-mode difflm-noshift --attention-mask-type no_mask
"""


def test_the_one_gpu_and_pipeline_layouts_train_the_same_on_cpu(tmp_path, capsys, monkeypatch):
    script = tmp_path / "tiny.sh"
    script.write_text(TINY_SCRIPT.format(root=ROOT))
    monkeypatch.setenv("MOCK_VOCAB_SIZE", "128")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CHECK_ARGS", "0")  # the scripts' flag check is test_launch_scripts.py's
    results = layout_parity.main(["--script", str(script), "--iters", "4", "--micro-batch-size", "1",
                                  "--global-batch-size", "4", "--layouts", "1gpu", "pp2",  # DP: the gloo suite
                                  "--log-dir", str(tmp_path / "logs"), "--port", "29650"])
    base = results["1gpu"]["losses"]
    assert len(base) == 4
    assert results["pp2"]["losses"] == pytest.approx(base, rel=1e-4)
    pipeline = results["pp2"]
    assert pipeline["bubble_formula"] == pytest.approx(1 / 5)  # 2 stages, 4 micro-batches
    assert 0 < pipeline["bubble"] < 1 and results["1gpu"]["bubble"] is None
    out = capsys.readouterr().out
    assert "| pp2 | 2 |" in out and "| 20.0% |" in out
