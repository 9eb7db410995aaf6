"""Supervised fine-tuning (--sft) under TP=2 with sequence parallelism and under DP=2 equals one
process: losses and step-1 gradients to 1e-5, in DLM and AR modes, with Megatron's default
configuration (biases on, LayerNorm) and the Llama style, EOD-padded and packed rows, and each
DLM recipe (--sft-normalizer)."""

import pytest

from tests.distributed.parity import tp_sp_and_dp

pytestmark = pytest.mark.distributed

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--mock-data", "--vocab-size", "120", "--add-mask-token",
         "--make-vocab-size-divisible-by", "32", "--lr", "1e-3", "--log-interval", "1000", "--eval-iters", "0",
         "--attention-backend", "math", "--train-iters", "3", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--sft",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
CONFIGS = {
    "megatron": [],
    "llama": ["--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
              "--normalization", "RMSNorm", "--swiglu", "--qk-layernorm", "--disable-bias-linear"],
}
MODES = {
    "dlm_llada_eos": ["--model-running-mode", "difflm-noshift", "--sft-normalizer", "llada"],
    "dlm_dfactory_pack": ["--model-running-mode", "difflm-noshift", "--sft-normalizer", "dfactory",
                          "--sft-padding", "pack"],
    "dlm_dllm_shift_pack": ["--model-running-mode", "difflm-shift", "--sft-normalizer", "dllm", "--sft-padding",
                            "pack"],
    "ar_eos": ["--model-running-mode", "vanilla"],
    "ar_pack": ["--model-running-mode", "vanilla", "--sft-padding", "pack"],
}
CASES = [("megatron", "dlm_llada_eos", ()), ("megatron", "ar_pack", ()), ("megatron", "dlm_dllm_shift_pack", ()),
         ("llama", "dlm_dfactory_pack", ()), ("llama", "ar_eos", ())]
SUITE = tp_sp_and_dp(CASES, lambda config, mode, extra: SHAPE + CONFIGS[config] + MODES[mode])

references = SUITE.references_fixture()


def test_sft_under_tp_sp_and_dp_matches_one_process(references, tmp_path):
    assert SUITE.check(2, references, tmp_path)
