"""The memory-bound parts of a training step, each timed alone on a model's real parameter set.

What the [perf] levers on the optimizer and the weight casts can buy, measured before building
them: every row moves a known number of bytes, so its time is set against the card's measured
copy bandwidth (one large device-to-device copy), which gives the floor a kernel could reach.

Rows (each the median of `--repeats` after `--warmup`, CUDA events; wall clock on CPU):
* adamw fused (grad_scale): today's step, the clip's multiply folded in (train_step's path);
* adamw foreach: torch's multi-tensor path without fusion;
* adamw compiled (`--compiled`): `torch.compile` of the foreach step (Triton, fused per group);
* CompiledAdamW (`--precision-aware`): our compiled step (--compile-optimizer-step) with fp32 moments,
  then with both stored in bf16 (Megatron's precision-aware optimizer: 20 bytes a parameter, not 28);
* CompiledAdamW under Inductor options (`--adamw-inductor`): the bf16-moment step compiled afresh
  under each set of `torch._inductor.config` options named (e.g. `combo_kernels=True`);
* grad norm: the clip's `_foreach_norm` over every gradient;
* bf16 weight copy: what bf16 autocast does to every fp32 weight in each forward;
* bf16 grad to fp32: the weight gradients' cast back to the fp32 parameters' dtype;
* loss kernel (`--loss-kernels`): the chunked loss's softmax, loss and logits gradient over one
  chunk of bf16 logits [--loss-chunk, vocabulary], torch.compile's kernel and the Triton kernel at
  each BLOCKxWARPS configuration named, against the 2 reads and 1 write of the logits both need;
* SwiGLU (`--swiglu-kernels`): the MLP's silu(gate) * up, forward and backward, over fc1's bf16
  output [--swiglu-tokens, 2 x ffn]: torch.compile's kernels and the Triton kernels at each
  BLOCKxWARPS named, against the 8 passes both need (forward: read gate and up, write the output;
  backward: read gate, up and the output gradient, write both gradients).
* float8 casts (`--float8-cast-tokens`): the float8 layers' cast of an activation or gradient (its amax,
  the scaled cast, the transposed copy the weight gradient reads) compiled as in a compiled layer, at each
  shape a decoder layer has, and its amax alone two ways (the rows' maxima first, as the layers take it, and
  one reduction over every element), and delayed scaling's cast (the scale given, the amax recorded) as
  tensor math and through the one-pass Triton kernel where it runs, against one pass over it (read 2 bytes
  an element, write 1 twice); on CUDA the profiler's kernel time (one call's GPU work, tens of microseconds,
  is shorter than its Python and autograd overhead, which the events would time instead); with them, where Triton
  runs, SwiGLU and fc2's input cast, then SwiGLU's backward and fc1's output-gradient cast, each as the
  two kernels the layers would run and as the float8 MLP's one (fused_float8_swiglu.py);
* float8 weight gradient (`--float8-weight-gradient-tokens`): a float8 layer's weight gradient over that many
  tokens added into an fp32 `.grad`, at each decoder linear's shape, two ways: `_scaled_mm`'s fp32 product
  then autograd's add (write 4 bytes a parameter, then read 8 and write 4), and cuBLASLt's GEMM adding it
  itself (cublaslt.scaled_mm_add_: read 4, write 4), with the 8 layers of one micro-batch summed;
* tied gradient (`--tied-tokens`): the embedding's rows of --tied-tokens looked-up ids added to the
  loss's fp32 [vocabulary, hidden] gradient of a tied weight: autograd's dense way (a zero-filled
  embedding gradient, then the sum of the two), the sorted `index_put_(accumulate=True)`, and
  `tied_gradient.add_rows` (index_add_), the way the model takes.

    python tools/benchmark/step_parts.py --model qwen3-1.7b --repeats 10 --compiled \
        --loss-kernels 4096x8,8192x16 --loss-chunk 4096 --swiglu-kernels 1024x4,2048x8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_breakdown  # noqa: E402
import train_throughput as shapes  # noqa: E402  (the named model shapes, shared with the training benchmark)

from megatron.core.tensor_parallel import linear_cross_entropy, tied_gradient  # noqa: E402
from megatron.core.fusions import fused_cross_entropy  # noqa: E402

from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer.compiled_adamw import CompiledAdamW  # noqa: E402
from megatron.core.optimizer.optimizer import param_groups  # noqa: E402
from megatron.core.fusions import fused_swiglu  # noqa: E402
from megatron.core.transformer.transformer_config import DLMConfig  # noqa: E402


def parameters(name: str, device: torch.device) -> List[torch.nn.Parameter]:
    """The fp32 parameters of the named shape, each with a random fp32 gradient."""
    spec = shapes.MODELS[name]
    with torch.device(device):
        model = GPTModel(shapes.transformer_config(spec, device),
                         DLMConfig(model_running_mode="difflm-noshift", mask_token_id=spec.vocab_size - 1))
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    return model, params


def timer(device: torch.device, warmup: int, repeats: int) -> Callable[[Callable[[], None]], float]:
    def measure(function: Callable[[], None]) -> float:
        for _ in range(warmup):
            function()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                function()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                function()
                times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)

    return measure


def kernel_timer(device: torch.device, warmup: int, repeats: int) -> Callable[[Callable[[], None]], float]:
    """The milliseconds of GPU kernels a call (the profiler's sum over `repeats` calls, divided), for
    parts whose GPU work is shorter than the host's launching of it; wall time on CPU."""
    if device.type != "cuda":
        return timer(device, warmup, repeats)

    def measure(function: Callable[[], None]) -> float:
        for _ in range(max(warmup, 1)):
            function()
        profile = kernel_breakdown.profile_steps(lambda index: function(), range(repeats), device)
        return profile["total_ms_per_step"]

    return measure


def adamw(model, fused: bool, foreach: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=fused or None, foreach=foreach or None)


def rows(model, params: List[torch.nn.Parameter], args, device: torch.device) -> Dict[str, tuple]:
    """{row: (milliseconds, bytes moved)}."""
    measure = timer(device, args.warmup, args.repeats)
    count = sum(p.numel() for p in params)
    grads = [p.grad for p in params]
    result = {}
    if device.type == "cuda":
        fused = adamw(model, True, False)

        def fused_step():
            fused.grad_scale = torch.tensor(1.0, device=device)
            fused.step()
        result["adamw fused (grad_scale)"] = (measure(fused_step), 28 * count)
        del fused
    foreach = adamw(model, False, True)
    result["adamw foreach"] = (measure(foreach.step), 28 * count)
    if args.compiled:
        compiled = torch.compile(foreach.step)
        begin = time.perf_counter()
        compiled()
        print(f"compiled the step in {time.perf_counter() - begin:.1f} s")
        result["adamw compiled (foreach, torch.compile)"] = (measure(compiled), 28 * count)
    if args.precision_aware:
        result.update(compiled_adamw_rows(model, measure, count))
    for variant in (args.adamw_inductor or "").split(",") if args.adamw_inductor else []:
        result.update(inductor_variant_row(model, measure, count, variant))
    result["grad norm (_foreach_norm)"] = (measure(lambda: torch._foreach_norm(grads, 2)), 4 * count)
    weights = [p for p in params if p.dim() == 2]
    matrix = sum(p.numel() for p in weights)
    half = [torch.empty_like(p, dtype=torch.bfloat16) for p in weights]
    result["bf16 weight copy (autocast's cast)"] = (measure(lambda: [p.to(torch.bfloat16) for p in weights]),
                                                    6 * matrix)
    result["bf16 weight copy, one multi-tensor copy"] = (measure(lambda: torch._foreach_copy_(half, weights)),
                                                         6 * matrix)
    result["bf16 grad to fp32"] = (measure(lambda: [h.float() for h in half]), 6 * matrix)
    if args.loss_kernels:
        result.update(loss_kernel_rows(shapes.MODELS[args.model].vocab_size, args, device, measure))
    if args.swiglu_kernels:
        result.update(swiglu_rows(shapes.MODELS[args.model].ffn_hidden_size, args, device, measure))
    if args.float8_cast_tokens:
        result.update(float8_cast_rows(shapes.MODELS[args.model], args, device,
                                       kernel_timer(device, args.warmup, args.repeats)))
        result.update(float8_swiglu_rows(shapes.MODELS[args.model].ffn_hidden_size, args.float8_cast_tokens, device,
                                         kernel_timer(device, args.warmup, args.repeats)))
    if args.float8_weight_gradient_tokens:
        result.update(float8_weight_gradient_rows(shapes.MODELS[args.model], args.float8_weight_gradient_tokens,
                                                  device, measure))
    if args.tied_tokens:
        spec = shapes.MODELS[args.model]
        result.update(tied_gradient_rows(spec.vocab_size, spec.hidden_size, args.tied_tokens, device, measure))
    return result


def tied_gradient_rows(vocab: int, hidden: int, tokens: int, device: torch.device, measure) -> Dict[str, tuple]:
    """A tied weight's two gradients summed: the loss's fp32 [vocab, hidden] and the embedding's rows of
    `tokens` ids (a quarter of them one repeated id, as frequent tokens are). The dense way writes a
    zeroed [vocab, hidden] tensor and its rows, then reads both and writes the sum (16 bytes an element
    plus the rows); adding the rows in place reads them and reads and writes their targets."""
    generator = torch.Generator(device).manual_seed(0)
    grad = torch.randn(vocab, hidden, device=device, generator=generator)
    ids = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    ids[: tokens // 4] = ids[0]
    rows = torch.randn(tokens, hidden, device=device, generator=generator)

    def dense():
        grad.add_(torch.ops.aten.embedding_dense_backward(rows, ids, vocab, -1, False))
    in_place = 12 * tokens * hidden
    return {f"tied gradient, dense embedding gradient + add ({tokens} ids)": (measure(dense), 16 * vocab * hidden
                                                                             + 8 * tokens * hidden),
            f"tied gradient, index_put_ accumulate ({tokens} ids)":
                (measure(lambda: grad.index_put_((ids,), rows, accumulate=True)), in_place),
            f"tied gradient, add_rows / index_add_ ({tokens} ids)":
                (measure(lambda: tied_gradient.add_rows(grad, ids, rows)), in_place)}


def compiled_adamw_rows(model, measure, count: int) -> Dict[str, tuple]:
    """CompiledAdamW's step with fp32 moments, then bf16 ones (each compiled on its first call)."""
    result = {}
    for dtype, moved in ((torch.float32, 28), (torch.bfloat16, 20)):
        optimizer = CompiledAdamW(param_groups(model, 0.1), lr=1e-4, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
        optimizer.grad_scale = torch.tensor(1.0, device=next(model.parameters()).device)
        name = "fp32" if dtype == torch.float32 else "bf16"
        result[f"adamw CompiledAdamW, {name} moments"] = (measure(optimizer.step), moved * count)
        del optimizer
    return result


def inductor_options(variant: str) -> dict:
    """`default` or `name=value+name=value` (values True, False or integers) as Inductor config options."""
    import torch._inductor.config as inductor

    if variant == "default":
        return {}
    options = {}
    for part in variant.split("+"):
        name, _, value = part.partition("=")
        if not hasattr(inductor, name) or not (value in ("True", "False") or value.isdigit()):
            raise ValueError(f"--adamw-inductor {variant!r}: {part!r} must be an Inductor option=True/False/integer")
        options[name] = value == "True" if value in ("True", "False") else int(value)
    return options


def inductor_variant_row(model, measure, count: int, variant: str) -> Dict[str, tuple]:
    """CompiledAdamW's bf16-moment step compiled afresh (dynamo reset) under one set of Inductor options."""
    options = inductor_options(variant)
    torch._dynamo.reset()
    optimizer = CompiledAdamW(param_groups(model, 0.1), lr=1e-4, exp_avg_dtype=torch.bfloat16,
                              exp_avg_sq_dtype=torch.bfloat16)
    optimizer.grad_scale = torch.tensor(1.0, device=next(model.parameters()).device)
    begin = time.perf_counter()
    with torch._inductor.config.patch(options):
        optimizer.step()  # compiles under the options; the timed calls reuse that code
    name, ms = f"adamw CompiledAdamW, bf16 moments, inductor {variant}", measure(optimizer.step)
    print(f"{name}: compiled in {time.perf_counter() - begin:.1f} s, {ms:.2f} ms", flush=True)  # before a time limit
    return {name: (ms, 20 * count)}


def loss_kernel_rows(vocab: int, args, device: torch.device, measure) -> Dict[str, tuple]:
    """The fused loss over one chunk of random bf16 logits: torch.compile's, then the Triton kernel's
    configurations (where Triton runs); every row moves the logits 3 times (2 reads, 1 write)."""
    generator = torch.Generator(device).manual_seed(0)
    logits = torch.randn(args.loss_chunk, vocab, device=device, generator=generator).to(torch.bfloat16) * 4
    targets = torch.randint(0, vocab, (args.loss_chunk,), device=device, generator=generator)
    scale = torch.rand(args.loss_chunk, device=device, generator=generator)
    moved = 3 * logits.numel() * logits.element_size()
    compiled = linear_cross_entropy.compiled_softmax_loss_gradient()
    name = f"loss kernel, torch.compile ({args.loss_chunk} x {vocab})"
    result = {name: (measure(lambda: compiled(logits, targets, scale, vocab)), moved)}
    if not fused_cross_entropy.available(logits):
        print("loss kernel: Triton does not run here; only torch.compile's row")
        return result
    work = logits.clone()
    for config in args.loss_kernels.split(","):
        block, warps = (int(value) for value in config.split("x"))

        def run(block=block, warps=warps):  # each call overwrites its input: start from the same logits
            work.copy_(logits)
            fused_cross_entropy.softmax_loss_gradient_(work, targets, scale, vocab, block=block, num_warps=warps)
        copy_ms = measure(lambda: work.copy_(logits))
        result[f"loss kernel, Triton, block {block}, {warps} warps"] = (measure(run) - copy_ms, moved)
    return result


def swiglu_rows(ffn: int, args, device: torch.device, measure) -> Dict[str, tuple]:
    """SwiGLU forward + backward over random bf16 fc1 output [tokens, 2 x ffn]: torch.compile's kernels
    (the forward and the backward autograd makes of them, as in a compiled layer), then the Triton kernels'
    configurations (where they run); every row moves tokens x ffn bf16 values 8 times."""
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(args.swiglu_tokens, 2 * ffn, device=device, generator=generator).to(torch.bfloat16)
    x.requires_grad_()
    grad = torch.randn(args.swiglu_tokens, ffn, device=device, generator=generator).to(torch.bfloat16)
    moved = 8 * args.swiglu_tokens * ffn * x.element_size()

    def timed(function):
        def step():
            x.grad = None
            function(x).backward(grad)
        return measure(step)
    name = f"swiglu forward+backward, torch.compile ({args.swiglu_tokens} x {ffn})"
    result = {name: (timed(torch.compile(fused_swiglu.reference)), moved)}
    if not fused_swiglu.available(x):
        print("swiglu: its Triton kernels do not run here; only torch.compile's row")
        return result
    for config in args.swiglu_kernels.split(","):
        block, warps = (int(value) for value in config.split("x"))
        label = f"swiglu forward+backward, Triton, block {block}, {warps} warps"
        result[label] = (timed(lambda x: fused_swiglu.swiglu(x, block=block, num_warps=warps)), moved)
    return result


def float8_cast_inputs(spec, tokens: int, device: torch.device) -> Dict[str, tuple]:
    """{name: (a bf16 [tokens, width] tensor, its float8 dtype)} for each cast a decoder layer makes."""
    from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES

    attention = spec.num_attention_heads * spec.kv_channels
    tensors = {"a hidden-width input (qkv, o, fc1)": (spec.hidden_size, FORWARD_DTYPE),
               "fc2's input": (spec.ffn_hidden_size, FORWARD_DTYPE),
               "fc1's output gradient": (2 * spec.ffn_hidden_size, GRADIENT_DTYPES["hybrid"]),
               "qkv's output gradient": (attention + 2 * spec.num_query_groups * spec.kv_channels,
                                         GRADIENT_DTYPES["hybrid"])}
    generator = torch.Generator(device).manual_seed(0)
    return {name: (torch.randn(tokens, width, device=device, generator=generator).to(torch.bfloat16), dtype)
            for name, (width, dtype) in tensors.items()}


def float8_cast_rows(spec, args, device: torch.device, measure) -> Dict[str, tuple]:
    """The float8 layers' casts of one micro-batch's activations and gradients (float8_matmul.float8_linear:
    the amax, the scaled cast, the transposed copy the weight gradient reads), compiled as in a compiled
    layer, at each shape they have in a decoder layer: the amax alone (the layers' rows-first reduction and
    one reduction over every element, read 2 bytes an element), the tensorwise cast (read 2 bytes an
    element, write 1 twice; the amax's own read keeps it above one pass), and delayed scaling's (the scale
    given, the amax recorded beside the cast), whole and in its two halves: the row-major values with the
    amax, and the transposed copy alone (read 2, write 1 each), which say whether the whole is one pass or
    two; and, where Triton runs, the layers' one-pass kernel (fused_float8_cast.py)."""
    from megatron.core.fp8 import float8_matmul
    from megatron.core.fusions import fused_float8_cast

    def both_layouts(x, dtype):
        values, inverse = float8_matmul.to_float8(x, dtype)
        return values, values.t().contiguous(), inverse

    def one_reduction(x, dtype):
        return float8_matmul.scale_of(x.abs().amax(), dtype)

    amax, scale = torch.zeros((), device=device), torch.tensor(10.0, device=device)

    def delayed(x, dtype, cast=float8_matmul.scaled_cast_both_layouts):  # by a given scale, the amax recorded
        values, transposed, inverse, x_amax = cast(x, dtype, scale)
        float8_matmul.raise_amax(amax, x_amax)
        return values, transposed, inverse

    def rows_only(x, dtype):
        float8_matmul.raise_amax(amax, float8_matmul.tensor_amax(x))
        return float8_matmul.scaled_cast(x, scale, dtype)

    def transposed_only(x, dtype):
        return float8_matmul.scaled_cast(x.t(), scale, dtype).contiguous()
    ways = {"amax, rows first": (float8_matmul.amax_scale, 2), "amax, one reduction": (one_reduction, 2),
            "both layouts": (both_layouts, 4), "delayed, tensor math": (delayed, 4),
            "delayed, rows only": (rows_only, 3), "delayed, transposed only": (transposed_only, 3)}
    fused_float8_cast.register_for(amax)
    if fused_float8_cast.available(torch.zeros(1, 1, device=device)):  # on CPU: a test's interpreter
        ways["delayed, Triton"] = (lambda x, dtype: delayed(x, dtype, float8_matmul.cast_both_layouts), 4)
    inputs, result = float8_cast_inputs(spec, args.float8_cast_tokens, device), {}
    for way, (function, bytes_per_element) in ways.items():
        cast = function if way == "delayed, Triton" else torch.compile(function)  # one kernel already
        for name, (x, dtype) in inputs.items():
            result[f"float8 cast, {way}: {name} [{' x '.join(map(str, x.shape))}]"] = (
                measure(lambda x=x, dtype=dtype: cast(x, dtype)), bytes_per_element * x.numel())
    return result


def float8_swiglu_rows(ffn: int, tokens: int, device: torch.device, measure) -> Dict[str, tuple]:
    """Where Triton runs: SwiGLU and fc2's float8 input cast (by a given scale, both layouts), then
    SwiGLU's backward and fc1's float8 output-gradient cast, each as the two kernels the layers run one
    after the other and as the one kernel of the float8 MLP (fused_float8_swiglu.py). Bytes an element of
    the activation: forward 10 then 6, backward 18 then 10."""
    from megatron.core.fp8 import float8_matmul
    from megatron.core.fusions import fused_float8_swiglu

    generator = torch.Generator(device).manual_seed(0)
    h = torch.randn(tokens, 2 * ffn, device=device, generator=generator).to(torch.bfloat16)
    grad = torch.randn(tokens, ffn, device=device, generator=generator).to(torch.bfloat16)
    scale, e4m3, e5m2 = torch.tensor(10.0, device=device), float8_matmul.FORWARD_DTYPE, torch.float8_e5m2
    fused_float8_swiglu.register_for(h)
    if not (fused_float8_swiglu.available(h) and fused_swiglu.available(h)):
        return {}
    ways = {"forward, SwiGLU then the cast": (lambda: float8_matmul.cast_both_layouts(fused_swiglu.swiglu(h), e4m3,
                                                                                      scale), 10),
            "forward, fused": (lambda: fused_float8_swiglu.swiglu_cast(h, scale, e4m3), 6),
            "backward, SwiGLU's then the cast": (lambda: float8_matmul.cast_both_layouts(
                fused_swiglu.swiglu_backward(grad, h), e5m2, scale), 18),
            "backward, fused": (lambda: fused_float8_swiglu.swiglu_backward_cast(grad, h, scale, e5m2), 10)}
    return {f"float8 SwiGLU, {way} [{tokens} x {ffn}]": (measure(function), per_element * tokens * ffn)
            for way, (function, per_element) in ways.items()}


def float8_weight_gradient_rows(spec, tokens: int, device: torch.device, measure) -> Dict[str, tuple]:
    """Each decoder linear's float8 weight gradient [out, in] over `tokens`, added into an fp32 gradient:
    `_scaled_mm` then the add, and in the GEMM (cublaslt.scaled_mm_add_); then a micro-batch's sum over the
    model's layers, each way. Bytes: the gradient's traffic (16 and 8 a parameter)."""
    from megatron.core.fusions import cublaslt
    from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES

    attention = spec.num_attention_heads * spec.kv_channels
    linears = {"qkv": (attention + 2 * spec.num_query_groups * spec.kv_channels, spec.hidden_size),
               "attention output": (spec.hidden_size, attention),
               "fc1": (2 * spec.ffn_hidden_size, spec.hidden_size),  # SwiGLU (train_throughput's shapes)
               "fc2": (spec.hidden_size, spec.ffn_hidden_size)}
    generator, one = torch.Generator(device).manual_seed(0), torch.ones((), device=device)
    bytes_per_parameter = {"_scaled_mm, then the add": 16, "in the GEMM (cuBLASLt, beta = 1)": 8}
    result, totals = {}, dict.fromkeys(bytes_per_parameter, 0.0)
    for name, (out_features, in_features) in linears.items():
        grad_t = torch.randn(out_features, tokens, device=device, generator=generator).to(GRADIENT_DTYPES["hybrid"])
        x_t = torch.randn(in_features, tokens, device=device, generator=generator).to(FORWARD_DTYPE)
        grad = torch.zeros(out_features, in_features, device=device)
        functions = [lambda: grad.add_(torch._scaled_mm(grad_t, x_t.t(), scale_a=one, scale_b=one,
                                                         out_dtype=torch.float32)),
                     lambda: cublaslt.scaled_mm_add_(grad, grad_t, x_t, one, one)]
        for (way, per_parameter), function in zip(bytes_per_parameter.items(), functions):
            milliseconds = measure(function)
            totals[way] += milliseconds * spec.num_layers
            result[f"float8 weight gradient, {way}: {name} [{out_features} x {in_features}], {tokens} tokens"] = (
                milliseconds, per_parameter * grad.numel())
    parameters = sum(out_features * in_features for out_features, in_features in linears.values()) * spec.num_layers
    for way, per_parameter in bytes_per_parameter.items():
        result[f"float8 weight gradient, {way}: a micro-batch, {spec.num_layers} layers"] = (
            totals[way], per_parameter * parameters)
    return result


def bandwidth(device: torch.device, measure: Callable[[Callable[[], None]], float], size: int) -> float:
    """Bytes per ms of one large device copy (read + write)."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * size / measure(lambda: target.copy_(source))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(shapes.MODELS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compiled", action="store_true", help="Also time the torch.compile'd foreach step.")
    parser.add_argument("--precision-aware", action="store_true",
                        help="Also time CompiledAdamW with fp32 and with bf16 moments.")
    parser.add_argument("--adamw-inductor", metavar="VARIANT,...",
                        help="Also time CompiledAdamW (bf16 moments) compiled under each set of Inductor options: "
                             "default or name=value+name=value (e.g. default,combo_kernels=True).")
    parser.add_argument("--loss-kernels", metavar="BxW,...",
                        help="Also time the fused loss: torch.compile's and the Triton kernel with these "
                             "column blocks x warps (e.g. 4096x8,8192x16).")
    parser.add_argument("--loss-chunk", type=int, default=4096, help="Tokens of the loss chunk timed.")
    parser.add_argument("--swiglu-kernels", metavar="BxW,...",
                        help="Also time SwiGLU forward+backward: torch.compile's and the Triton kernels with these "
                             "column blocks x warps (e.g. 1024x4,2048x8).")
    parser.add_argument("--swiglu-tokens", type=int, default=8192, help="Tokens of the SwiGLU input timed.")
    parser.add_argument("--float8-cast-tokens", type=int, default=0,
                        help="Also time the float8 layers' casts (amax, cast, transposed copy) over this many tokens.")
    parser.add_argument("--float8-weight-gradient-tokens", type=int, default=0,
                        help="Also time the float8 weight gradient added into .grad two ways over this many tokens.")
    parser.add_argument("--tied-tokens", type=int, default=0,
                        help="Also time a tied weight's two gradients summed over this many ids (e.g. 8192).")
    parser.add_argument("--json", help="Also write the results here.")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    for flag, value in (("--loss-kernels", args.loss_kernels), ("--swiglu-kernels", args.swiglu_kernels)):
        if value and not all(part.count("x") == 1 and part.replace("x", "").isdigit() for part in value.split(",")):
            parser.error(f"{flag} {value!r} must be BLOCKxWARPS pairs, e.g. 4096x8,8192x16")
    try:
        [inductor_options(variant) for variant in (args.adamw_inductor or "default").split(",")]
    except ValueError as error:
        parser.error(str(error))
    if args.loss_chunk < 1 or args.swiglu_tokens < 1 or min(args.tied_tokens, args.float8_cast_tokens,
                                                             args.float8_weight_gradient_tokens) < 0:
        parser.error("--loss-chunk and --swiglu-tokens must be >= 1, --tied-tokens, "
                     "--float8-cast-tokens and --float8-weight-gradient-tokens >= 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, params = parameters(args.model, device)
    per_ms = bandwidth(device, timer(device, args.warmup, args.repeats), 2 ** 30 if device.type == "cuda" else 2 ** 24)
    table = rows(model, params, args, device)
    print(f"{args.model}: {sum(p.numel() for p in params) / 1e6:.1f}M parameters; copy bandwidth "
          f"{per_ms / 1e9:.2f} TB/s ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__})")
    print("| part | ms | GB moved | TB/s | floor ms at the copy bandwidth |\n|---|---|---|---|---|")
    for name, (ms, moved) in table.items():
        print(f"| {name} | {ms:.2f} | {moved / 1e9:.1f} | {moved / ms / 1e9:.2f} | {moved / per_ms:.2f} |")
    result = {"model": args.model, "parameters": sum(p.numel() for p in params), "copy_tb_per_s": per_ms / 1e9,
              "torch": torch.__version__,
              "rows": {name: {"ms": ms, "bytes": moved} for name, (ms, moved) in table.items()}}
    if args.json:
        shapes.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
