"""tools/benchmark/step_parts.py on CPU at the tiny shape: its rows, the bytes each moves and the
JSON it writes. No speed is asserted."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "benchmark"))
import step_parts  # noqa: E402

from megatron.core.fusions import triton_support  # noqa: E402


def test_rows_count_the_bytes_of_the_real_parameter_set(tmp_path, capsys):
    out = tmp_path / "parts.json"
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows, count = result["rows"], result["parameters"]
    model, params = step_parts.parameters("tiny", step_parts.torch.device("cpu"))
    assert count == sum(p.numel() for p in params) > 0
    assert rows["adamw foreach"]["bytes"] == 28 * count  # param, two moments read and written; grad read
    matrices = sum(p.numel() for p in params if p.dim() == 2)
    assert rows["bf16 weight copy (autocast's cast)"]["bytes"] == 6 * matrices < 6 * count
    assert all(row["ms"] > 0 for row in rows.values()) and result["copy_tb_per_s"] > 0
    assert "| adamw foreach |" in capsys.readouterr().out


def test_precision_aware_rows_move_fewer_bytes(monkeypatch):
    monkeypatch.setattr(step_parts.torch, "compile", lambda function, **options: function)  # the bytes, not speed
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1", "--precision-aware"])
    rows, count = result["rows"], result["parameters"]
    assert rows["adamw CompiledAdamW, fp32 moments"]["bytes"] == 28 * count
    assert rows["adamw CompiledAdamW, bf16 moments"]["bytes"] == 20 * count


def test_inductor_variant_rows_compile_under_their_options(monkeypatch):
    """Each --adamw-inductor variant compiles the bf16-moment step afresh inside its options' patch."""
    seen = []

    def compile_once(function, **_):
        def first_call(*args, **kwargs):
            seen.append(step_parts.torch._inductor.config.combo_kernels)
            return function(*args, **kwargs)
        return first_call
    monkeypatch.setattr(step_parts.torch, "compile", compile_once)
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1",
                              "--adamw-inductor", "default,combo_kernels=True"])
    names = [name for name in result["rows"] if "inductor" in name]
    assert names == ["adamw CompiledAdamW, bf16 moments, inductor default",
                     "adamw CompiledAdamW, bf16 moments, inductor combo_kernels=True"]
    assert all(result["rows"][name]["bytes"] == 20 * result["parameters"] for name in names)
    # the options hold for the second variant's compiling step only (its two parameter groups' calls)
    assert seen.count(True) == 2 and seen[0] is False and seen[-1] is False, seen
    assert step_parts.inductor_options("coordinate_descent_tuning=True+max_autotune_pointwise=False") == {
        "coordinate_descent_tuning": True, "max_autotune_pointwise": False}


def test_tied_gradient_rows_time_the_dense_and_the_in_place_sums():
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1", "--tied-tokens", "32"])
    spec = step_parts.shapes.MODELS["tiny"]
    tied = {name: row for name, row in result["rows"].items() if name.startswith("tied gradient")}
    assert len(tied) == 3 and all(row["ms"] > 0 for row in tied.values())
    elements, rows = spec.vocab_size * spec.hidden_size, 32 * spec.hidden_size
    assert tied["tied gradient, dense embedding gradient + add (32 ids)"]["bytes"] == 16 * elements + 8 * rows
    assert tied["tied gradient, add_rows / index_add_ (32 ids)"]["bytes"] == 12 * rows
    assert not any(name.startswith("tied gradient") for name in step_parts.main(
        ["--model", "tiny", "--warmup", "0", "--repeats", "1"])["rows"])


def test_float8_weight_gradient_rows_time_both_ways_at_each_linear_shape():
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1",
                              "--float8-weight-gradient-tokens", "32"])
    spec = step_parts.shapes.MODELS["tiny"]
    rows = {name: row for name, row in result["rows"].items() if name.startswith("float8 weight gradient")}
    assert len(rows) == 2 * 4 + 2 and all(row["ms"] > 0 for row in rows.values())
    fc1 = 2 * spec.ffn_hidden_size * spec.hidden_size
    assert rows[f"float8 weight gradient, _scaled_mm, then the add: fc1 [{2 * spec.ffn_hidden_size} x "
                f"{spec.hidden_size}], 32 tokens"]["bytes"] == 16 * fc1
    for way in ("then the add", "in the GEMM"):  # a micro-batch: each linear once a layer
        linears = [row for name, row in rows.items() if way in name and "layers" not in name]
        total = next(row for name, row in rows.items() if way in name and "layers" in name)
        assert total["ms"] == pytest.approx(spec.num_layers * sum(row["ms"] for row in linears))
        assert total["bytes"] == spec.num_layers * sum(row["bytes"] for row in linears)


def test_loss_kernel_rows_time_both_kernels_on_one_chunk(monkeypatch):
    """The fused loss's rows: torch.compile's kernel and, where Triton is installed (under its interpreter,
    tests/conftest.py), the Triton kernel launched at each configuration named (passed to it, the module's
    defaults left alone), each moving the logits 3 times."""
    kernel = step_parts.fused_cross_entropy
    default = (kernel.BLOCK, kernel.NUM_WARPS)
    launches, real = [], kernel.softmax_loss_gradient_
    monkeypatch.setattr(kernel, "softmax_loss_gradient_",
                        lambda *a, **k: launches.append((k["block"], k["num_warps"])) or real(*a, **k))
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1",
                              "--loss-kernels", "64x4,256x8", "--loss-chunk", "3"])
    vocab = step_parts.shapes.MODELS["tiny"].vocab_size
    names = [name for name in result["rows"] if name.startswith("loss kernel")]
    triton_rows = ["loss kernel, Triton, block 64, 4 warps", "loss kernel, Triton, block 256, 8 warps"]
    has_triton = importlib.util.find_spec("triton") is not None
    assert names == [f"loss kernel, torch.compile (3 x {vocab})", *(triton_rows if has_triton else [])]
    assert all(result["rows"][name]["bytes"] == 3 * 3 * vocab * 2 for name in names)
    assert set(launches) == ({(64, 4), (256, 8)} if has_triton else set())
    assert (kernel.BLOCK, kernel.NUM_WARPS) == default


def test_swiglu_rows_time_both_implementations(monkeypatch):
    """SwiGLU's rows: torch.compile's kernels and, where the Triton kernels run (under the interpreter on
    CPU, when a test allows it), launched at each configuration named (passed to them, the module's defaults
    left alone), each moving 8 passes."""
    kernel = step_parts.fused_swiglu
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    default = (kernel.BLOCK, kernel.NUM_WARPS)
    launches, real = [], kernel.swiglu
    monkeypatch.setattr(kernel, "swiglu", lambda x, **k: launches.append((k["block"], k["num_warps"])) or real(x, **k))
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1",
                              "--swiglu-kernels", "64x4,128x8", "--swiglu-tokens", "5"])
    ffn = step_parts.shapes.MODELS["tiny"].ffn_hidden_size
    names = [name for name in result["rows"] if name.startswith("swiglu")]
    triton_rows = ["swiglu forward+backward, Triton, block 64, 4 warps",
                   "swiglu forward+backward, Triton, block 128, 8 warps"]
    has_triton = importlib.util.find_spec("triton") is not None
    assert names == [f"swiglu forward+backward, torch.compile (5 x {ffn})", *(triton_rows if has_triton else [])]
    assert all(result["rows"][name]["bytes"] == 8 * 5 * ffn * 2 for name in names)
    assert set(launches) == ({(64, 4), (128, 8)} if has_triton else set())
    assert (kernel.BLOCK, kernel.NUM_WARPS) == default


@pytest.mark.parametrize("flags", [["--loss-kernels", "64"], ["--loss-kernels", "64x4,x"], ["--loss-chunk", "0"],
                                   ["--swiglu-kernels", "1024"], ["--swiglu-tokens", "0"],
                                   ["--adamw-inductor", "no_such_option=True"],
                                   ["--adamw-inductor", "combo_kernels=x"]])
def test_bad_loss_kernel_flags_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        step_parts.main(["--model", "tiny", *flags])
    assert exit_info.value.code == 2 and flags[0] in capsys.readouterr().err


def test_bad_repeats_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        step_parts.main(["--model", "tiny", "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats" in capsys.readouterr().err


def test_float8_cast_rows_cast_each_decoder_shape(monkeypatch):
    """Each row runs the layers' amax or cast at the shape a decoder layer gives it (the amax rows: the
    layers' scale, both ways the same; the casts: the values, transposed copy and scale float8_linear
    makes, by the tensor's amax or, delayed, by the given scale, and the delayed cast's two halves alone)
    and counts its bytes: the amax reads 2 an element, a cast also writes 1 twice (a half: once). Where
    the layers' Triton kernel runs (under the interpreter here), its row too, not compiled (one kernel)."""
    import torch

    from megatron.core.fp8.float8_matmul import scaled_cast, to_float8

    seen = []
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)

    def recording_compile(function, **options):
        name = getattr(function, "__name__", "delayed")

        def run(x, dtype):
            expected, expected_inverse = to_float8(x, dtype)
            if name in ("delayed", "rows_only", "transposed_only"):
                expected, expected_inverse = scaled_cast(x, torch.tensor(10.0), dtype), torch.tensor(0.1)
            seen.append((name, tuple(x.shape), dtype))
            if name in ("amax_scale", "one_reduction"):
                scale = function(x, dtype)
                assert torch.equal(scale.reciprocal(), expected_inverse)
                return scale
            if name in ("rows_only", "transposed_only"):  # delayed scaling's two halves
                half = function(x, dtype)
                whole = expected if name == "rows_only" else expected.t()
                assert half.is_contiguous() and torch.equal(half.float(), whole.float())
                return half
            values, transposed, inverse = function(x, dtype)
            assert values.dtype == dtype and torch.equal(transposed.float(), values.t().float())
            assert torch.equal(values.float(), expected.float())
            assert torch.equal(inverse, expected_inverse)
            return values, transposed, inverse
        return run
    monkeypatch.setattr(step_parts.torch, "compile", recording_compile)  # the casts' results, not speed
    result = step_parts.main(["--model", "tiny", "--warmup", "0", "--repeats", "1", "--float8-cast-tokens", "32"])
    spec = step_parts.shapes.MODELS["tiny"]
    rows = {name: row for name, row in result["rows"].items() if name.startswith("float8 cast")}
    widths = [spec.hidden_size, spec.ffn_hidden_size, 2 * spec.ffn_hidden_size,
              (spec.num_attention_heads + 2 * spec.num_query_groups) * spec.kv_channels]
    ways = {"amax, rows first": 2, "amax, one reduction": 2, "both layouts": 4, "delayed, tensor math": 4,
            "delayed, rows only": 3, "delayed, transposed only": 3}
    compiled = len(ways)
    if triton_support.HAS_TRITON and triton_support.interpreting():
        ways["delayed, Triton"] = 4
    assert [name.split(":")[0].removeprefix("float8 cast, ") for name in rows] == [w for w in ways for _ in widths]
    assert [row["bytes"] for row in rows.values()] == [ways[w] * 32 * width for w in ways for width in widths]
    assert sorted({shape for _, shape, _ in seen}) == sorted({(32, width) for width in widths})
    assert {dtype for _, _, dtype in seen} == {torch.float8_e4m3fn, torch.float8_e5m2}
    assert len(seen) == compiled * len(widths)


def test_float8_swiglu_rows_time_the_layers_pair_and_the_fused_kernel(monkeypatch):
    """Where the kernels run (the interpreter here): four rows at fc2's width, the two kernels the layers run
    one after the other and the fused one, each way; their bytes (an element of the activation: 10 and 6
    forward, 18 and 10 backward); and every one computes the MLP's values (the fused kernels' own tests
    check the bytes: tests/unit_tests/test_float8_mlp.py), so each timed function is called."""
    from megatron.core.fusions import fused_float8_swiglu

    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    calls = []
    for name in ("swiglu_cast", "swiglu_backward_cast"):
        original = getattr(fused_float8_swiglu, name)
        monkeypatch.setattr(fused_float8_swiglu, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    spec = step_parts.shapes.MODELS["tiny"]
    rows = step_parts.float8_swiglu_rows(spec.ffn_hidden_size, 32, step_parts.torch.device("cpu"),
                                         lambda function: (function(), 1.0)[1])
    if not (triton_support.HAS_TRITON and triton_support.interpreting()):
        assert rows == {}
        return
    ways = {"forward, SwiGLU then the cast": 10, "forward, fused": 6, "backward, SwiGLU's then the cast": 18,
            "backward, fused": 10}
    width = spec.ffn_hidden_size
    assert {name: row[1] for name, row in rows.items()} == {
        f"float8 SwiGLU, {way} [32 x {width}]": per * 32 * width for way, per in ways.items()}
    assert calls == ["swiglu_cast", "swiglu_backward_cast"]
