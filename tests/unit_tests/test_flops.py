"""The FLOPs formula against a hand count, mask means against dense masks, peaks and MFU."""

import pytest

from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flops import (
    attention_keys_per_query,
    forward_flops_breakdown,
    forward_flops_per_token,
    peak_tflops,
    throughput_metrics,
    training_flops_per_iteration,
)

SEQ = 32


def small_config(**changes) -> TransformerConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  kv_channels=16, ffn_hidden_size=96, gated_linear_unit=True, vocab_size=100)
    fields.update(changes)
    return TransformerConfig(**fields)


# Hand count for small_config() at seq 32, per token, 2 FLOPs per multiply-accumulate:
#   qkv:        hidden 64 -> (4 + 2*2) * 16 = 128 outputs:  2 * 64 * 128 = 16384 per layer
#   attention:  q@k^T and p@v, 4 heads * 16 = 64 wide, 32 keys:  2 * 2 * 64 * 32 = 8192
#   out proj:   64 -> 64:                                    2 * 64 * 64 = 8192
#   mlp:        fc1 64 -> 192 (gated), fc2 96 -> 64:  2*64*192 + 2*96*64 = 24576 + 12288 = 36864
#   output:     64 -> 100 once:                              2 * 64 * 100 = 12800
HAND_PER_LAYER_NO_ATTENTION = 16384 + 8192 + 36864
HAND_ATTENTION_BIDIRECTIONAL = 8192
HAND_OUTPUT_LAYER = 12800


def test_no_mask_matches_hand_count_term_by_term():
    terms = forward_flops_breakdown(small_config(), SEQ, "no_mask")
    assert terms == {"qkv": 2 * 16384, "core_attention": 2 * 8192, "attention_output": 2 * 8192,
                     "mlp": 2 * 36864, "output_layer": 12800}
    expected = 2 * (HAND_PER_LAYER_NO_ATTENTION + HAND_ATTENTION_BIDIRECTIONAL) + HAND_OUTPUT_LAYER
    assert forward_flops_per_token(small_config(), SEQ) == expected


def test_causal_attention_term_is_exactly_half_of_bidirectional():
    full = forward_flops_breakdown(small_config(), SEQ, "no_mask")
    causal = forward_flops_breakdown(small_config(), SEQ, "causal")
    assert causal["core_attention"] == full["core_attention"] / 2
    for name in ("qkv", "attention_output", "mlp", "output_layer"):
        assert causal[name] == full[name]
    expected = 2 * (HAND_PER_LAYER_NO_ATTENTION + HAND_ATTENTION_BIDIRECTIONAL / 2) + HAND_OUTPUT_LAYER
    assert forward_flops_per_token(small_config(), SEQ, "causal") == expected
    # Megatron's spelling of causal counts the same.
    assert forward_flops_per_token(small_config(), SEQ, "causal_bottom_right") == expected


def test_ungated_mlp_has_single_fc1():
    terms = forward_flops_breakdown(small_config(gated_linear_unit=False), SEQ)
    assert terms["mlp"] == 2 * (2 * 64 * 96 + 2 * 96 * 64)


def test_gqa_reduces_only_the_qkv_term():
    mha = forward_flops_breakdown(small_config(num_query_groups=4), SEQ)
    gqa = forward_flops_breakdown(small_config(num_query_groups=2), SEQ)
    mqa = forward_flops_breakdown(small_config(num_query_groups=1), SEQ)
    assert mha["qkv"] == 2 * 2 * 64 * (4 + 2 * 4) * 16
    # Each kv head dropped removes a key and a value projection of width head_dim.
    assert mha["qkv"] - gqa["qkv"] == 2 * 2 * 64 * (2 * 2 * 16)
    assert mqa["qkv"] < gqa["qkv"] < mha["qkv"]
    for name in ("core_attention", "attention_output", "mlp", "output_layer"):
        assert mha[name] == gqa[name] == mqa[name]


def brute_force_keys_per_query(mask: AttentionMask, seq_length: int) -> float:
    visible = mask.dense(seq_length)[0, 0]
    return visible.sum().item() / seq_length


@pytest.mark.parametrize("seq_length,block_size", [(32, 1), (32, 4), (32, 8), (32, 32), (24, 6)])
def test_block_causal_mean_matches_dense_mask(seq_length, block_size):
    dense = brute_force_keys_per_query(AttentionMask("block_causal", block_size=block_size), seq_length)
    assert attention_keys_per_query("block_causal", seq_length, block_size=block_size) == pytest.approx(dense)


@pytest.mark.parametrize("seq_length,window", [(32, 1), (32, 5), (32, 16), (32, 32), (32, 100), (7, 3)])
@pytest.mark.parametrize("mask_type", ["sliding_window", "sliding_window_two_sided"])
def test_sliding_window_mean_matches_dense_mask(seq_length, window, mask_type):
    dense = brute_force_keys_per_query(AttentionMask(mask_type, window=window), seq_length)
    assert attention_keys_per_query(mask_type, seq_length, window=window) == pytest.approx(dense)


def test_sliding_window_defaults_to_config_window():
    config = small_config(sliding_window=8)
    from_config = forward_flops_per_token(config, SEQ, "sliding_window")
    explicit = forward_flops_per_token(small_config(), SEQ, "sliding_window", window=8)
    assert from_config == explicit


def test_no_mask_and_causal_conventions():
    assert attention_keys_per_query("no_mask", SEQ) == SEQ
    assert attention_keys_per_query("causal", SEQ) == SEQ / 2


@pytest.mark.parametrize("mask_type,kwargs", [
    ("block_causal", {}), ("block_causal", {"block_size": 5}), ("sliding_window", {}),
    ("sliding_window", {"window": 0}), ("dilated", {})])
def test_bad_mask_arguments_raise(mask_type, kwargs):
    with pytest.raises(ValueError):
        attention_keys_per_query(mask_type, SEQ, **kwargs)


def test_training_flops_is_three_forwards_per_token_and_ignores_recompute():
    config = small_config()
    forward = forward_flops_per_token(config, SEQ, "no_mask")
    assert training_flops_per_iteration(config, SEQ, global_batch_size=8) == 3 * 8 * SEQ * forward
    recomputed = small_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert training_flops_per_iteration(recomputed, SEQ, 8) == training_flops_per_iteration(config, SEQ, 8)


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA H200", "bf16", 989.0), ("NVIDIA H200", "fp8", 1979.0),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100-SXM4-80GB", "fp8", None),
    ("NVIDIA B200", "fp8", 4500.0), ("nvidia h200", "bfloat16", 989.0),
    ("cpu", "bf16", None), (None, "bf16", None)])
def test_peak_lookup(name, dtype, expected):
    assert peak_tflops(name, dtype) == expected


def test_peak_lookup_rejects_unknown_dtype():
    with pytest.raises(ValueError):
        peak_tflops("NVIDIA H200", "int4")


def test_throughput_and_mfu_arithmetic():
    # 8 GPUs, 2 s per iteration, 7.912e15 FLOPs -> 494.5 TFLOP/s per GPU = half an H200.
    metrics = throughput_metrics(7.912e15, tokens_per_iteration=65536, seconds_per_iteration=2.0,
                                 world_size=8, peak=989.0)
    assert metrics["tflops_per_gpu"] == pytest.approx(494.5)
    assert metrics["tokens_per_sec_per_gpu"] == pytest.approx(4096.0)
    assert metrics["mfu"] == pytest.approx(0.5)
    assert throughput_metrics(7.912e15, 65536, 2.0, 8, peak=None)["mfu"] is None
    with pytest.raises(ValueError):
        throughput_metrics(1.0, 1, 0.0, 1, None)


def test_moe_layers_count_active_parameters():
    """small_config() with layer 1 of 2 an MoE of 8 experts, top-2, expert ffn 32, a shared expert of 48:
        router:  64 -> 8:                                   2 * 64 * 8 = 1024
        experts: 2 x (fc1 64 -> 64 gated, fc2 32 -> 64):    2 * (2*64*64 + 2*32*64) = 2 * 12288 = 24576
        shared:  fc1 64 -> 96 gated, fc2 48 -> 64:          2*64*96 + 2*48*64 = 12288 + 6144 = 18432
    and layer 0 keeps the dense MLP (36864). Expert choice with capacity factor 1.5 counts 3 experts."""
    from megatron.core.transformer.moe.config import MoEConfig

    moe = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32, shared_expert_intermediate_size=48,
                    layer_freq="[0,1]")
    terms = forward_flops_breakdown(small_config(moe=moe), SEQ, "no_mask")
    assert (terms["mlp"], terms["moe_router"], terms["moe_experts"], terms["moe_shared_expert"]) == \
        (36864, 1024, 24576, 18432)
    choice = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32, router_type="expert_choice",
                       expert_capacity_factor=1.5)
    terms = forward_flops_breakdown(small_config(moe=choice), SEQ, "no_mask")
    assert terms["moe_experts"] == 2 * 3 * 12288 and terms["mlp"] == 0 and terms["moe_shared_expert"] == 0
