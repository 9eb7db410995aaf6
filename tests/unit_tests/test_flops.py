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


def test_output_positions_charge_the_output_layer_where_it_runs():
    config = small_config()
    megatron = training_flops_per_iteration(config, SEQ, 8)
    assert training_flops_per_iteration(config, SEQ, 8, output_positions=SEQ) == megatron
    # 10 of the 32 positions: the other 22 of each of the 8 sequences lose the output layer's 3 passes
    assert training_flops_per_iteration(config, SEQ, 8, output_positions=10) == \
        megatron - 3 * 8 * 22 * HAND_OUTPUT_LAYER
    block = training_flops_per_iteration(config, SEQ, 8, "block_diffusion", block_size=8, output_positions=0)
    assert block == training_flops_per_iteration(config, SEQ, 8, "block_diffusion", block_size=8) \
        - 3 * 8 * SEQ * HAND_OUTPUT_LAYER


# --difflm-eps 0.2 --difflm-t-min 0.2 --difflm-t-max 0.6: E[t] = 0.4, E[p] = 0.8 * 0.4 + 0.2 = 0.52
# of the maskable positions: all 32 in difflm-noshift, 31 in difflm-shift (position 0 is never masked).
T_RANGE = ["--difflm-eps", "0.2", "--difflm-t-min", "0.2", "--difflm-t-max", "0.6"]
MASKED_PER_ROW = {"difflm-noshift": 32 * 0.52, "difflm-shift": 31 * 0.52}


def header(runtime, capsys, *flags) -> tuple:
    """(the trainer, the header line `log_start` prints) of the tiny model with `flags`."""
    from tests.unit_tests.test_training import make_trainer

    trainer = make_trainer(runtime, "--train-iters", "1", "--global-batch-size", "4", "--micro-batch-size", "2",
                           *T_RANGE, *flags)
    capsys.readouterr()
    trainer.logger.log_start(trainer.model)
    line = next(line for line in capsys.readouterr().out.splitlines() if "TFLOP per iteration" in line)
    return trainer, line


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift"])
def test_the_header_counts_the_output_layer_at_the_masked_positions_only(runtime, capsys, mode):
    import re

    full, full_line = header(runtime, capsys, "--model-running-mode", mode)
    masked, masked_line = header(runtime, capsys, "--model-running-mode", mode, "--difflm-masked-only-loss")
    config = full.logger.record.transformer_config
    unmasked = SEQ - MASKED_PER_ROW[mode]
    output_layer = 2 * config.hidden_size * config.vocab_size
    difference = full.logger.flops_per_iteration - masked.logger.flops_per_iteration
    assert difference == pytest.approx(3 * 4 * unmasked * output_layer, rel=1e-12)
    printed = [float(value) for value in re.findall(r"([0-9.e+-]+) TFLOP per iteration", full_line + masked_line)]
    assert printed == pytest.approx([full.logger.flops_per_iteration / 1e12, masked.logger.flops_per_iteration / 1e12],
                                    rel=1e-3)
    # Megatron's count, the output layer at every position, beside it and labelled; nothing to add without the flag
    assert "Megatron's formula" not in full_line
    megatron = re.search(r"\(Megatron's formula, the output layer at every position: ([0-9.e+-]+)\)", masked_line)
    assert float(megatron.group(1)) == pytest.approx(full.logger.flops_per_iteration / 1e12, rel=1e-3)


@pytest.mark.parametrize("changes", [
    dict(model_running_mode="difflm-noshift", t_sampling="uniform"),
    dict(model_running_mode="difflm-shift", t_sampling="antithetic", eps=0.2, t_min=0.2, t_max=0.6),
    dict(model_running_mode="difflm-noshift", t_sampling="antithetic", block_diffusion=True, block_size=8,
         ignore_bos=True, t_min=0.3, t_max=0.8)])
def test_output_layer_positions_are_the_mean_of_the_masked_only_selection(changes):
    """The expectation the count uses against what the masked-only path selects (weights != 0), the mean
    over 4096 corrupted rows, within 5 standard errors (antithetic t makes the error smaller still)."""
    import torch

    from megatron.core.models.difflm.diffusion import CorruptionKey
    from megatron.core.models.difflm.objective import loss_inputs, output_layer_positions
    from megatron.core.transformer.transformer_config import DLMConfig

    dlm = DLMConfig(mask_token_id=99, masked_only_loss=True, **changes).validate(vocab_size=100, seq_length=SEQ)
    rows = 4096
    ids = torch.randint(0, 99, (rows, SEQ), generator=torch.Generator().manual_seed(0))
    key = CorruptionKey.for_batch(dlm.seed, iteration=3, global_batch_size=rows, first_sample_index=0,
                                  batch_size=rows)
    selected = (loss_inputs(ids, dlm, key, clamp_normalizer=False).weights != 0).sum(dim=1).double()
    tolerance = 5 * selected.std().item() / rows ** 0.5
    assert selected.mean().item() == pytest.approx(output_layer_positions(dlm, SEQ), abs=tolerance)
    vanilla = DLMConfig(model_running_mode="vanilla", masked_only_loss=True)
    assert output_layer_positions(vanilla, SEQ) == SEQ
