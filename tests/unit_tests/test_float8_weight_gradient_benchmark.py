"""tools/benchmark/float8_weight_gradient.py on CPU: its rows (the kernel's under Triton's interpreter),
each way's product checked against fp64, the model's shapes and the per-micro-batch totals. No speed is
asserted."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "benchmark"))
import float8_weight_gradient  # noqa: E402

from megatron.core import triton_support  # noqa: E402
from megatron.core.tensor_parallel import triton_float8_matmul  # noqa: E402


def test_every_way_computes_the_product_and_the_totals_add_up(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    out = tmp_path / "f8.json"
    result = float8_weight_gradient.main(["--shapes", "64x32,48x96", "--tokens", "80", "--warmup", "0",
                                          "--repeats", "1", "--fast-accumulation", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    ways = ["scaled_mm", "scaled_mm, bf16 out (torchao's)", "scaled_mm + add", "kernel, promoting every 128",
            "kernel, fast accumulation"]
    assert list(result["rows"]) == [f"weight {i} {shape}, {way}" for i, shape in enumerate(("64x32", "48x96"))
                                    for way in ways]
    for name, row in result["rows"].items():  # each way's product, the bf16 one rounded to bf16
        assert row["ms"] > 0 and (1e-4 < row["error"] < 1e-2 if "bf16" in name else row["error"] < 1e-5), name
    assert {row["op_takes"] for row in result["rows"].values()} == {"kernel"}  # the interpreter's: always
    for way in ways:
        assert result["micro_batch_ms"][way] == pytest.approx(sum(
            row["ms"] for name, row in result["rows"].items() if name.endswith(", " + way)))
    assert triton_float8_matmul.PROMOTE_EVERY == 128  # the fast-accumulation row restored it


def test_the_models_shapes_are_its_decoder_linears():
    spec = float8_weight_gradient.shapes.MODELS["7b-shape"]
    assert float8_weight_gradient.linear_shapes(spec) == {"query/key/value": (6144, 4096),
                                                          "attention output": (4096, 4096),
                                                          "fc1": (28672, 4096), "fc2": (4096, 14336)}


@pytest.mark.parametrize("flags", [["--tokens", "40"], ["--shapes", "64x30"], ["--shapes", "64by32"]])
def test_bad_flags_are_one_line(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        float8_weight_gradient.main(flags)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_kernel_builds_for_the_h100_and_h200_in_every_configuration():
    """Triton's compiler and its ptxas, no GPU: every autotuned tile, with and without the promotion,
    builds for sm_90 (a kernel that only fails on the GPU machine would cost its scarce time). In a fresh
    process: triton.jit reads TRITON_INTERPRET, which the tests set, when the kernel is made."""
    import os
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = ROOT / "tools" / "benchmark" / "float8_weight_gradient.py"
    run = subprocess.run([sys.executable, str(script), "--build-report", "90"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ") and "x" in line]
    assert len(rows) == 2 * len(triton_float8_matmul.TILES)
    for tile, promotion, shared, registers, spilled in rows:
        assert promotion.strip() in ("128", "None") and int(shared) > 0 and 0 < int(registers) <= 255, tile
