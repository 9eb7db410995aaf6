"""The Hugging Face baseline of tools/benchmark/train_throughput.py: the plain transformers model of a
shape, made bidirectional for the DLM step (LLaDA's loss), with the optimizer recipe both steps use.

Kept apart so the benchmark's own step, timing and reporting stay one readable file; the benchmark
re-exports these names (its tests reach them through it).
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch
from torch import nn

import moe_models

# The optimizer settings of the launch scripts (examples/dlm_training/dlm_pretrain_1.7b.sh), both steps'.
LR, WEIGHT_DECAY, BETAS, CLIP_GRAD, DLM_EPS = 2e-4, 0.1, (0.9, 0.95), 1.0, 1e-3


def transformers_version() -> Optional[str]:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def mask_token_id(spec) -> int:
    """The last vocabulary row; the random batches never contain it."""
    return spec.vocab_size - 1

def hf_model(spec, experts_implementation: Optional[str] = None):
    """The plain transformers model of the shape (random init, SDPA, fp32 weights)."""
    import transformers

    if spec.moe is not None:
        return moe_models.olmoe_model(spec, experts_implementation)

    config_class, model_class = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[spec.family]
    config = config_class(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups, head_dim=spec.kv_channels,
        max_position_embeddings=spec.max_positions, rms_norm_eps=spec.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rotary_base},
        tie_word_embeddings=spec.tied_embeddings, attention_bias=False, attention_dropout=0.0,
        initializer_range=0.02, use_cache=False, attn_implementation="sdpa")
    return model_class(config)


def leaks_future(model: nn.Module, vocab_size: int, forward_kwargs: Callable[[torch.Tensor], dict]) -> bool:
    """True when the logits at position 0 change if only the last token changes, i.e. when
    attention is bidirectional (a causal model's position 0 cannot see the future)."""
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab_size - 1, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % (vocab_size - 1)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        first = model(input_ids=tokens, **forward_kwargs(tokens)).logits[0, 0].float()
        second = model(input_ids=changed, **forward_kwargs(changed)).logits[0, 0].float()
    model.train(was_training)
    return not torch.allclose(first, second, rtol=0.0, atol=1e-6)


def make_bidirectional(model: nn.Module, vocab_size: int) -> tuple[Callable[[torch.Tensor], dict], str]:
    """Turn a transformers decoder bidirectional; returns (forward kwargs of a batch, how).

    First the flags (config.is_causal, read by transformers 5's mask creation and SDPA
    integration, and each attention module's is_causal): no mask is built, so SDPA keeps its
    flash/cuDNN kernels. Versions that ignore them get an explicit all-True 4-D mask instead
    (slower kernels, still correct). Each way is verified with `leaks_future`."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config.is_causal = False
        if hasattr(module, "is_causal"):
            module.is_causal = False

    def no_kwargs(tokens: torch.Tensor) -> dict:
        return {}

    def full_mask(tokens: torch.Tensor) -> dict:
        batch, seq = tokens.shape
        ones = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=tokens.device)
        return {"attention_mask": ones.expand(batch, 1, seq, seq)}

    for forward_kwargs, how in ((no_kwargs, "is_causal=False flags"), (full_mask, "explicit all-True 4-D mask")):
        if leaks_future(model, vocab_size, forward_kwargs):
            return forward_kwargs, how
    raise RuntimeError("could not make the transformers model bidirectional (is_causal flags and a 4-D mask both "
                       f"left it causal); transformers {transformers_version()} is not supported for --mode dlm")


def llada_loss(model: nn.Module, tokens: torch.Tensor, forward_kwargs: dict, mask_id: int,
               generator: torch.Generator, aux_loss: Optional[Callable] = None) -> torch.Tensor:
    """LLaDA's pretraining loss: mask each token with probability p = (1 - eps) t + eps,
    cross-entropy on the masked tokens weighted 1/p, divided by B*L; plus `aux_loss(outputs)`
    when given (an MoE model's router balancing loss)."""
    batch, seq = tokens.shape
    t = torch.rand(batch, 1, device=tokens.device, generator=generator)
    p_mask = ((1 - DLM_EPS) * t + DLM_EPS).expand(batch, seq)
    masked = torch.rand(batch, seq, device=tokens.device, generator=generator) < p_mask
    noisy = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
    outputs = model(input_ids=noisy, **forward_kwargs)
    token_loss = nn.functional.cross_entropy(outputs.logits[masked].float(), tokens[masked], reduction="none")
    loss = (token_loss / p_mask[masked]).sum() / (batch * seq)
    return loss if aux_loss is None else loss + aux_loss(outputs)


def build_hf(spec, args: argparse.Namespace, device: torch.device):
    """The transformers model, fused AdamW, its step (batch, step index) -> detached loss, and notes."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = hf_model(spec, getattr(args, "hf_experts_implementation", None))
    model = model.to(device).train()
    forward_kwargs, how = (lambda tokens: {}), "causal"
    if args.mode == "dlm":
        forward_kwargs, how = make_bidirectional(model, spec.vocab_size)
    # MoE: the router balancing loss, which the model itself adds only when given labels (AR).
    aux_loss, info = None, {"attention": how}
    if spec.moe is not None:
        aux_loss = moe_models.router_aux_loss(model)
        info["experts_implementation"] = moe_models.experts_implementation(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                  fused=device.type == "cuda")
    generator = torch.Generator(device).manual_seed(args.seed)

    def step(tokens: torch.Tensor, index: int) -> torch.Tensor:
        micro_batches = tokens.split(args.micro_batch_size)  # --accumulation of them, then one optimizer step
        for micro in micro_batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                if args.mode == "dlm":
                    loss = llada_loss(model, micro, forward_kwargs(micro), mask_token_id(spec), generator, aux_loss)
                else:
                    loss = model(input_ids=micro, labels=micro).loss
            (loss / len(micro_batches) if len(micro_batches) > 1 else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return model, optimizer, step, info
