"""Every parallel layout equals one process over the configurations users actually run.

The matrix crosses each layout with model configurations that between them take every value
of every axis (linear biases on and off, LayerNorm and RMSNorm, qk-layernorm, GeLU and
SwiGLU, tied and untied embeddings, --add-qkv-bias, RoPE and learned absolute positions), in DLM and AR
modes. `megatron` is Megatron-LM's default configuration with RoPE (no flags: biases on, LayerNorm, GeLU,
tied), `gpt3` the same with Megatron-LM's default learned position table; `llama`
and `qwen2` are the styles most DLMs start from. Each layout trains all its configurations
in one set of processes (spawning costs more than a tiny training), and every loss and
step-1 gradient must match the single-process run to 1e-5.
"""

import pytest

from tests.distributed.parity import LayoutCases

pytestmark = pytest.mark.distributed

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--mock-data", "--vocab-size", "120", "--add-mask-token",
         "--make-vocab-size-divisible-by", "32", "--lr", "1e-3", "--log-interval", "1000", "--eval-iters", "0",
         "--attention-backend", "math", "--train-iters", "3", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--reset-attention-mask", "--reset-position-ids",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
GQA = ["--group-query-attention", "--num-query-groups", "2"]
UNTIED = ["--untie-embeddings-and-output-weights"]
CONFIGS = {
    "megatron": [],
    "llama": GQA + UNTIED + ["--normalization", "RMSNorm", "--swiglu", "--qk-layernorm", "--disable-bias-linear"],
    "qwen2": GQA + UNTIED + ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--add-qkv-bias"],
    "layernorm_qk_swiglu": ["--qk-layernorm", "--swiglu", "--add-qkv-bias"],
    # Megatron-LM's default GPT entirely: its learned absolute position table instead of RoPE
    "gpt3": ["--position-embedding-type", "learned_absolute"],
}
MODES = {"dlm": ["--model-running-mode", "difflm-noshift", "--difflm-t-sampling", "antithetic"],
         "ar": ["--model-running-mode", "vanilla"]}
ALL = [(config, mode) for config in CONFIGS for mode in MODES]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]

# layout: (world size, parallel flags, the (config, mode) pairs it trains)
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"], ALL),
    "tp2_sp": (2, TP2_SP, ALL),
    "dp2": (2, [], ALL),
    "dp2_zero1": (2, ["--use-distributed-optimizer"], [("megatron", "dlm"), ("qwen2", "ar")]),
    "dp2_zero2": (2, ["--data-parallel-sharding-strategy", "optim_grads"], [("llama", "dlm"), ("megatron", "ar")]),
    "dp2_fsdp2": (2, ["--data-parallel-sharding-strategy", "optim_grads_params"],
                  [("megatron", "ar"), ("layernorm_qk_swiglu", "dlm"), ("gpt3", "dlm")]),
    "tp2_sp_dp2": (4, TP2_SP, [("megatron", "dlm"), ("megatron", "ar"), ("llama", "dlm"), ("qwen2", "ar"),
                               ("gpt3", "ar")]),
    "tp4_two_kv_heads": (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"],
                         [("llama", "ar"), ("qwen2", "dlm")]),
}


def argv_of(config: str, mode: str) -> list:
    return SHAPE + CONFIGS[config] + MODES[mode]


SUITE = LayoutCases({name: (world, flags, [(config, mode, ()) for config, mode in pairs],
                             world > 1 and "tensor" not in " ".join(flags))
                      for name, (world, flags, pairs) in LAYOUTS.items()},
                     lambda config, mode, extra: argv_of(config, mode))


references = SUITE.references_fixture()


def test_every_axis_value_appears_under_tp_sp_and_under_dp():
    def values(pairs):
        flags = {flag for config, _ in pairs for flag in CONFIGS[config]}
        return {"bias": {"--disable-bias-linear" in CONFIGS[c] for c, _ in pairs},
                "norm": {"--normalization" in CONFIGS[c] for c, _ in pairs},
                "qk": {"--qk-layernorm" in CONFIGS[c] for c, _ in pairs},
                "mlp": {"--swiglu" in CONFIGS[c] for c, _ in pairs},
                "tied": {"--untie-embeddings-and-output-weights" in CONFIGS[c] for c, _ in pairs},
                "positions": {"learned_absolute" in CONFIGS[c] for c, _ in pairs},
                "qkv_bias": "--add-qkv-bias" in flags, "modes": {m for _, m in pairs}}

    for layout in ("tp2_sp", "dp2"):
        seen = values(LAYOUTS[layout][2])
        assert seen.pop("qkv_bias") and seen.pop("modes") == set(MODES)
        assert all(axis == {True, False} for axis in seen.values()), (layout, seen)


@pytest.mark.parametrize("world_size", SUITE.world_sizes())
def test_layouts_match_one_process(world_size, references, tmp_path):
    """Every layout of LAYOUTS with `world_size` processes, each (config, mode) against one process."""
    assert SUITE.check(world_size, references, tmp_path)
