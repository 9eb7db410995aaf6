"""The float8 layers' weight gradient in a micro-batch after a step's first, each way timed alone at a
model's decoder linear shapes (what `triton_float8_matmul` was built to save, measured before the step).

Rows, per linear weight [out, in] (query/key/value, attention output, fc1, fc2) with --tokens rows:
* scaled_mm: cuBLAS's float8 GEMM writing a fresh fp32 product (a step's first micro-batch);
* scaled_mm, bf16 out: the same GEMM writing bf16, as torchao's recipe does (its error is the yardstick
  for the others': what rounding each micro-batch's gradient to bf16 costs);
* scaled_mm + add: the fp32 product added into the fp32 `.grad` in a pass of its own (autograd's sum, the
  float8 layers' way before the kernel);
* kernel: triton_float8_matmul's GEMM adding into `.grad` in its epilogue, promoting its float8 sums
  into fp32 every PROMOTE_EVERY products (the layers' way now; its autotuned tile is printed);
* kernel, fast accumulation (`--fast-accumulation`): the same without the promotion.
and which way the layers' op keeps for the shape (it times the kernel against scaled_mm + add when it
first meets one).
Each row: the median ms of `--repeats` after `--warmup` (CUDA events; wall clock on CPU), TFLOP/s, and
the largest error of the first `--check-rows` rows of the sum against fp64, relative to their largest
value. The table ends with the model's total a micro-batch (every layer's four weights): the kernel's
time against scaled_mm + add's is what it saves a micro-batch after the first.

    python tools/benchmark/float8_weight_gradient.py --model 7b-shape --tokens 8192 --fast-accumulation
    python tools/benchmark/float8_weight_gradient.py --build-report 90     # any machine: the kernel's build
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_throughput as shapes  # noqa: E402  (the named model shapes)
from step_parts import timer  # noqa: E402

from megatron.core.tensor_parallel import triton_float8_matmul  # noqa: E402


def linear_shapes(spec: "shapes.ModelSpec") -> Dict[str, Tuple[int, int]]:
    """The decoder's linear weights [out, in] of one layer (SwiGLU: fc1 holds gate and up)."""
    attention = spec.num_attention_heads * spec.kv_channels
    return {"query/key/value": (attention + 2 * spec.num_query_groups * spec.kv_channels, spec.hidden_size),
            "attention output": (spec.hidden_size, attention),
            "fc1": (2 * spec.ffn_hidden_size, spec.hidden_size), "fc2": (spec.hidden_size, spec.ffn_hidden_size)}


def _operands(out_features: int, in_features: int, tokens: int, device: torch.device):
    """The backward's operands: the output gradient's e5m2 cast and the input's e4m3 one, both
    transposed ([out, tokens], [in, tokens]), their inverse scales, and an fp32 `.grad` to add into."""
    generator = torch.Generator(device).manual_seed(0)
    grad = torch.randn(out_features, tokens, device=device, generator=generator).to(torch.float8_e5m2)
    x = torch.randn(in_features, tokens, device=device, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.tensor(3e-3, device=device), torch.tensor(2e-2, device=device)
    return grad, x, scales, torch.zeros(out_features, in_features, device=device)


def _error(product: torch.Tensor, grad, x, scales, rows: int) -> float:
    """max |product - exact product| over the first `rows` rows, over the largest |exact product|."""
    exact = (grad[:rows].double() @ x.double().t()) * (scales[0].double() * scales[1].double())
    return ((product[:rows].double() - exact).abs().max() / exact.abs().max()).item()


def _ways(args, kernel: bool) -> List[Tuple[str, object]]:
    """(row name, function(out, grad, x, scales)) for each way timed."""
    def scaled_mm(out, grad, x, scales):
        return triton_float8_matmul.float8_product(grad, x, *scales)

    def kernel_with(promote):
        def run(out, grad, x, scales):
            triton_float8_matmul.PROMOTE_EVERY = promote
            triton_float8_matmul._launch(out, grad, x, *scales)
        return run
    def scaled_mm_bf16(out, grad, x, scales):
        return torch._scaled_mm(grad, x.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
    ways = [("scaled_mm", scaled_mm), ("scaled_mm, bf16 out (torchao's)", scaled_mm_bf16),
            ("scaled_mm + add", lambda out, grad, x, scales: triton_float8_matmul._cublas(out, grad, x, *scales))]
    if kernel:
        ways.append((f"kernel, promoting every {triton_float8_matmul.PROMOTE_EVERY}",
                     kernel_with(triton_float8_matmul.PROMOTE_EVERY)))
        if args.fast_accumulation:
            ways.append(("kernel, fast accumulation", kernel_with(None)))
    return ways


def measure_shape(name: str, shape: Tuple[int, int], args, device: torch.device) -> Dict[str, dict]:
    grad, x, scales, out = _operands(*shape, args.tokens, device)
    measure, flops = timer(device, args.warmup, args.repeats), 2 * shape[0] * shape[1] * args.tokens
    rows, default = {}, triton_float8_matmul.PROMOTE_EVERY
    try:
        for way, function in _ways(args, triton_float8_matmul.kernel_runs_on(out)):
            out.zero_()  # one call into zeros: the product it computes, checked against fp64
            result = function(out, grad, x, scales)
            error = _error(out if result is None else result, grad, x, scales, min(args.check_rows, shape[0]))
            ms = measure(lambda: function(out, grad, x, scales))
            tuned = way.startswith("kernel") and device.type == "cuda"
            tile = getattr(triton_float8_matmul._autotuned(), "best_config", "") if tuned else ""
            rows[f"{name} {shape[0]}x{shape[1]}, {way}"] = dict(ms=ms, tflops=flops / ms / 1e9, error=error,
                                                                 tile=str(tile))
    finally:
        triton_float8_matmul.PROMOTE_EVERY = default
    takes = "kernel" if triton_float8_matmul.uses_kernel(out, grad, x, *scales) else "scaled_mm + add"
    for row in rows.values():
        row["op_takes"] = takes  # the way the layers' op keeps for the shape (timed on its first call)
    return rows


def build_report(capability: int = 90) -> List[dict]:
    """Each autotuned configuration of the kernel built for the card (no GPU needed: Triton's compiler
    and its bundled ptxas and cuobjdump): shared memory, registers a thread and bytes spilled to the
    stack, with and without the promotion. Triton's internal compile API, so a newer Triton may need
    this function changed; the kernel's own launch does not depend on it."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    kernel, rows = triton_float8_matmul._kernel(False), []
    for promote in (triton_float8_matmul.PROMOTE_EVERY, None):
        for block_m, block_n, warps, stages in triton_float8_matmul.TILES:
            constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, PROMOTE=promote)
            signature = {"a_desc": f"tensordesc<fp8e5[{block_m}, 128]>",
                         "b_desc": f"tensordesc<fp8e4nv[{block_n}, 128]>", "out_ptr": "*fp32", "scale_a_ptr": "*fp32",
                         "scale_b_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                         **{name: "constexpr" for name in constexprs}}
            divisible = {(index,): [["tt.divisibility", 16]] for index in range(2, 8)}  # as a launch specialises
            source = triton.compiler.ASTSource(kernel, signature, constexprs, divisible)
            built = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                   options=dict(num_warps=warps, num_stages=stages))
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(built.asm["cubin"])
                cubin.flush()
                usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name],
                                       capture_output=True, text=True, check=True).stdout
            registers, stack = (re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK"))
            rows.append(dict(tile=f"{block_m}x{block_n}, {warps} warps, {stages} stages", promote=promote,
                             shared=built.metadata.shared, registers=int(registers.group(1)),
                             spilled=int(stack.group(1))))
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b-shape", choices=sorted(shapes.MODELS))
    parser.add_argument("--tokens", type=int, default=8192, help="Rows of the micro-batch (micro-batch x seq).")
    parser.add_argument("--shapes", help="OUTxIN,... instead of the model's (e.g. 64x32 for a CPU check).")
    parser.add_argument("--fast-accumulation", action="store_true", help="Also time the kernel without promotion.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed calls first (the kernel autotunes in them).")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--check-rows", type=int, default=256, help="Rows of each sum checked against fp64.")
    parser.add_argument("--build-report", type=int, metavar="CAPABILITY",
                        help="Only build the kernel's configurations for this card (90: H100/H200) and print their "
                             "registers, spills and shared memory; no GPU needed.")
    parser.add_argument("--json", help="Also write the results here.")
    args = parser.parse_args(argv)
    if args.build_report:
        rows = build_report(args.build_report)
        print("| tile | promotion | shared bytes | registers | bytes spilled |\n|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['tile']} | {row['promote']} | {row['shared']} | {row['registers']} | {row['spilled']} |")
        return {"build_report": rows}
    if min(args.tokens, args.repeats, args.check_rows) < 1 or args.warmup < 0 or args.tokens % 16:
        parser.error("--tokens (a multiple of 16), --repeats and --check-rows must be >= 1, --warmup >= 0")
    spec = shapes.MODELS[args.model]
    try:
        named = ({f"weight {i}": tuple(int(v) for v in part.split("x")) for i, part in
                  enumerate(args.shapes.split(","))} if args.shapes else linear_shapes(spec))
    except ValueError:
        parser.error(f"--shapes {args.shapes!r} must be OUTxIN pairs, e.g. 64x32,96x64")
    if any(len(shape) != 2 or min(shape) < 16 or max(v % 16 for v in shape) for shape in named.values()):
        parser.error("every --shapes dimension must be a multiple of 16")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = {}
    for name, shape in named.items():
        rows.update(measure_shape(name, shape, args, device))
    layers = 1 if args.shapes else spec.num_layers
    print(f"{'--shapes ' + args.shapes if args.shapes else args.model}, {args.tokens} tokens "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__})")
    print("| weight, way | ms | TFLOP/s | error / amax | tile | the op takes |\n|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['ms']:.3f} | {row['tflops']:.1f} | {row['error']:.1e} | {row['tile']} | "
              f"{row['op_takes']} |")
    totals = {}
    for name, row in rows.items():
        way = name.split(", ", 1)[1]
        totals[way] = totals.get(way, 0.0) + layers * row["ms"]
    print(f"a micro-batch, {layers} layer(s): " + "; ".join(f"{way} {ms:.2f} ms" for way, ms in totals.items()))
    result = {"model": args.model, "tokens": args.tokens, "torch": torch.__version__, "rows": rows,
              "micro_batch_ms": totals}
    if args.json:
        shapes.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
