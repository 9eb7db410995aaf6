"""The one FLOPs formula of the project, and the throughput/MFU numbers derived from it.

Every TFLOP/s, tokens/s and MFU figure that MegaDLMs logs or benchmarks comes from this
file, so numbers are comparable between runs, mask types and model sizes. Frameworks count
differently (reference/frameworks.md section 4.2), so the convention is fixed here:

* Only matrix multiplications are counted, 2 FLOPs per multiply-accumulate. Norms, softmax,
  rotary embeddings, activations, dropout, residual adds, the embedding lookup and the loss
  are not counted: they are memory-bound and a small fraction of the work.
* Per token and per layer (h = hidden, a = query heads, g = kv heads, d = head dim,
  f = ffn hidden, V = vocabulary, k = keys a query attends to on average):
    - fused QKV projection  2 * h * (a + 2g) * d
    - core attention        2 * 2 * a * d * k   (q @ k^T and probs @ v)
    - output projection     2 * a * d * h
    - MLP                   2 * h * f * (2 if gated else 1)  +  2 * f * h
  plus the output layer 2 * h * V once per position it runs at (tied or not, it is a matmul).
* The output layer runs where the loss needs logits: at every position in Megatron's formula, but
  under --difflm-masked-only-loss in the DLM modes only at the masked ones, E[p] of the maskable
  positions (about half; objective.output_layer_positions). The step's count
  (`executed_flops_per_iteration`: the console, tensorboard, the benchmarks) charges the output
  layer there only; `training_flops_per_iteration` without `output_positions` is Megatron's count,
  which the run's header prints beside it where the two differ.
* MoE layers count their *active* parameters: the router 2 * h * E, the experts a token goes
  through, k x the MLP formula with the expert ffn size (k = topk; under expert choice the
  average k x capacity factor), and the shared expert's MLP. Dropped tokens (a capacity factor
  under token choice) are still counted: the nominal work, as Megatron counts it.
* Attention counts the keys the mask lets through: bidirectional (``no_mask``) counts the
  full s keys, causal counts s/2 (Megatron's convention), block_causal and sliding_window
  count their exact mean. This is why a DLM step reports more FLOPs than an AR step.
* Block diffusion (BD3-LM) runs every sample of L tokens as [x_t ; x_0], 2L tokens: everything
  but the output layer is counted for 2L tokens, the output layer for the L noisy ones (the only
  logits the loss needs), and a query sees (L + B) / 2 keys on average (the mask's exact density:
  a noisy query in block b sees its own block and the b clean blocks before it, a clean query the
  b + 1 clean blocks up to its own), the same mean as block_causal over L.
* Training is 3 x forward (backward = 2 x forward: activation and weight gradients). These
  are *model* FLOPs: activation recompute is deliberately NOT counted, so MFU does not rise
  when a run recomputes more (the MFU convention of the PaLM paper and Megatron).
"""

from __future__ import annotations

import math
from typing import Optional

from megatron.core.models.difflm.objective import output_layer_positions
from megatron.core.transformer.transformer_config import MASK_TYPE_ALIASES, DLMConfig, TransformerConfig

JOINT_BLOCK_DIFFUSION = "block_diffusion_causal_clean"
"""The attention the joint AR + DLM objective executes (DLMConfig.causal_clean_half): block diffusion's over
[x_t ; x_0] with a token-causal clean half; a FLOPs count's mask type, no model's."""

# Dense (no structured sparsity) tensor-core peaks in TFLOP/s, from the vendors' data sheets.
# Keys are matched as case-insensitive substrings of torch.cuda.get_device_name(); the longest
# matching key wins, so "H100 PCIe" is preferred over "H100" for the PCIe card.
# fp16 peaks equal the bf16 ones on these cards. A100 has no fp8 tensor cores.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0},
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H100 PCIe": {"bf16": 756.0, "fp8": 1513.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0},
}
_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "bf16", "float16": "bf16",
                  "fp8": "fp8", "float8": "fp8"}


def attention_keys_per_query(mask_type: str, seq_length: int, block_size: Optional[int] = None,
                             window: Optional[int] = None) -> float:
    """Average number of keys a query attends to under `mask_type` (the `k` of the module doc).

    Core attention cost is proportional to this, so it is what separates the FLOPs of a
    bidirectional DLM from an AR model of the same shape. Causal uses s/2 rather than the
    exact (s+1)/2 to stay comparable with Megatron's published numbers.
    """
    mask_type = MASK_TYPE_ALIASES.get(mask_type, mask_type)
    if seq_length <= 0:
        raise ValueError(f"seq_length={seq_length} must be a positive integer")
    if mask_type == "no_mask":
        return float(seq_length)
    if mask_type == "causal":
        return seq_length / 2.0
    if mask_type in ("block_causal", "block_diffusion", JOINT_BLOCK_DIFFUSION):  # block diffusion: the noisy L
        if not block_size or block_size <= 0 or seq_length % block_size:
            raise ValueError(f"block_size={block_size!r} must be a positive divisor of seq_length="
                             f"{seq_length} for block_causal; pass the --block-size of the run")
        if mask_type == JOINT_BLOCK_DIFFUSION:  # noisy queries (s + B) / 2 keys, clean ones causal: s / 2
            return (2.0 * seq_length + block_size) / 4.0
        # Query in block b (0-based) sees (b + 1) * B keys; averaging over n = s/B blocks
        # gives B * (n + 1) / 2 = (s + B) / 2.
        return (seq_length + block_size) / 2.0
    if mask_type in ("sliding_window", "sliding_window_two_sided") and (not window or window <= 0):
        raise ValueError(f"window={window!r} must be a positive integer for {mask_type}; "
                         "pass --sliding-window <tokens>")
    if mask_type == "sliding_window_two_sided":
        # Query i sees the keys within distance m = min(window, s) - 1 on each side, cut at the ends:
        # s keys at distance 0, plus 2 (s - d) pairs at each distance d = 1..m.
        reach = min(window, seq_length) - 1
        return (seq_length + 2 * (reach * seq_length - reach * (reach + 1) / 2)) / seq_length
    if mask_type == "sliding_window":
        # Query i sees min(i + 1, window) keys: a triangle for the first positions, then flat.
        ramp = min(window, seq_length)
        total = ramp * (ramp + 1) / 2.0 + (seq_length - ramp) * window
        return total / seq_length
    raise ValueError(f"mask_type={mask_type!r} is not one of no_mask, causal, block_causal, "
                     f"block_diffusion, {JOINT_BLOCK_DIFFUSION}, sliding_window, sliding_window_two_sided")


def forward_flops_breakdown(config: TransformerConfig, seq_length: int, mask_type: str = "no_mask",
                            block_size: Optional[int] = None,
                            window: Optional[int] = None) -> dict[str, float]:
    """Forward matmul FLOPs per token, by term, summed over all layers.

    Exposed separately so tests and benchmarks can check each term against a hand count.
    `window` defaults to `config.sliding_window`, the value the model itself uses.
    """
    if window is None:
        window = config.sliding_window
    hidden = config.hidden_size
    query_width = config.num_attention_heads * config.kv_channels
    kv_width = config.num_query_groups * config.kv_channels
    keys = attention_keys_per_query(mask_type, seq_length, block_size, window)
    layers, moe = config.num_layers, config.moe
    moe_layers = sum(moe.layer_flags) if moe is not None else 0
    terms = {
        "qkv": layers * 2.0 * hidden * (query_width + 2 * kv_width),
        "core_attention": layers * 2.0 * 2.0 * query_width * keys,
        "attention_output": layers * 2.0 * query_width * hidden,
        "mlp": (layers - moe_layers) * _mlp_flops(config, config.ffn_hidden_size),
        "output_layer": 2.0 * hidden * config.vocab_size,
    }
    if moe_layers:
        experts_per_token = moe.router_topk
        if moe.router_type == "expert_choice" and moe.expert_capacity_factor is not None:
            experts_per_token *= moe.expert_capacity_factor
        shared = moe.shared_expert_intermediate_size
        terms["moe_router"] = moe_layers * 2.0 * hidden * moe.num_experts
        terms["moe_experts"] = moe_layers * experts_per_token * _mlp_flops(config, moe.expert_ffn_size(
            config.ffn_hidden_size))
        terms["moe_shared_expert"] = moe_layers * (_mlp_flops(config, shared) if shared else 0.0)
    return terms


def _mlp_flops(config: TransformerConfig, ffn: int) -> float:
    """One token through an MLP of inner width `ffn`: fc1 (gate and up when gated) and fc2."""
    return 2.0 * config.hidden_size * ffn * (2 if config.gated_linear_unit else 1) + 2.0 * ffn * config.hidden_size


def forward_flops_per_token(config: TransformerConfig, seq_length: int, mask_type: str = "no_mask",
                            block_size: Optional[int] = None, window: Optional[int] = None) -> float:
    """Forward matmul FLOPs for one token of a `seq_length` sequence (see the module doc); under
    block_diffusion, per token of the L-token sample (its forward runs 2L tokens)."""
    terms = forward_flops_breakdown(config, seq_length, mask_type, block_size, window)
    if mask_type in ("block_diffusion", JOINT_BLOCK_DIFFUSION):
        return 2.0 * (sum(terms.values()) - terms["output_layer"]) + terms["output_layer"]
    return sum(terms.values())


def training_flops_per_iteration(config: TransformerConfig, seq_length: int, global_batch_size: int,
                                 mask_type: str = "no_mask", block_size: Optional[int] = None,
                                 window: Optional[int] = None, output_positions: Optional[float] = None) -> float:
    """Model FLOPs of one optimizer step over `global_batch_size` sequences of `seq_length`.

    3 x forward (backward costs twice the forward). Activation recompute is not counted, as
    `config.recompute_granularity` changes the hardware work but not the model FLOPs that MFU
    is defined on. Sequences are counted at their nominal length (padding included), like
    Megatron. `output_positions`: the positions of a sequence (block diffusion: of its L noisy
    tokens) the output layer runs at; None: all of them, Megatron's count.
    """
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive integer")
    tokens = global_batch_size * seq_length
    per_token = forward_flops_per_token(config, seq_length, mask_type, block_size, window)
    if output_positions is None:
        return 3.0 * tokens * per_token
    output_layer = forward_flops_breakdown(config, seq_length, mask_type, block_size, window)["output_layer"]
    return 3.0 * (tokens * (per_token - output_layer) + global_batch_size * output_positions * output_layer)


def executed_flops_per_iteration(config: TransformerConfig, dlm: DLMConfig, seq_length: int,
                                 global_batch_size: int) -> float:
    """The model FLOPs a training step of this objective executes: its mask's attention, and the
    output layer at the positions the loss takes logits at (see the module doc)."""
    mask_type = JOINT_BLOCK_DIFFUSION if dlm.causal_clean_half else dlm.effective_mask_type
    return training_flops_per_iteration(config, seq_length, global_batch_size, mask_type=mask_type,
                                        block_size=dlm.block_size, window=config.sliding_window,
                                        output_positions=output_layer_positions(dlm, seq_length))


def peak_tflops(device_name: Optional[str], dtype: str = "bf16") -> Optional[float]:
    """Dense peak TFLOP/s of `device_name` for `dtype`, or None when unknown (CPU, other cards).

    None rather than a guess, so that MFU is left out of the log instead of being wrong.
    """
    if dtype.lower() not in _DTYPE_ALIASES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPE_ALIASES)}")
    if not device_name:
        return None
    name = device_name.lower()
    matches = [key for key in PEAK_TFLOPS if key.lower() in name]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)].get(_DTYPE_ALIASES[dtype.lower()])


def throughput_metrics(flops_per_iteration: float, tokens_per_iteration: float,
                       seconds_per_iteration: float, world_size: int,
                       peak: Optional[float]) -> dict[str, Optional[float]]:
    """TFLOP/s per GPU, tokens/s per GPU and MFU (a fraction of `peak` TFLOP/s, None without it).

    Logged together because MFU alone hides the formula; tokens/s is formula-free and is what
    compares across frameworks (reference/frameworks.md section 4.2).
    """
    if not seconds_per_iteration > 0 or not math.isfinite(seconds_per_iteration):
        raise ValueError(f"seconds_per_iteration={seconds_per_iteration} must be a positive number")
    if world_size <= 0:
        raise ValueError(f"world_size={world_size} must be a positive integer")
    gpu_seconds = seconds_per_iteration * world_size
    tflops_per_gpu = flops_per_iteration / gpu_seconds / 1e12
    return {
        "tflops_per_gpu": tflops_per_gpu,
        "tokens_per_sec_per_gpu": tokens_per_iteration / gpu_seconds,
        "mfu": tflops_per_gpu / peak if peak else None,
    }
