"""A Megatron-LM torch_dist or legacy torch checkpoint (made by megatron-core: tests/assets/megatron/) loaded with
--finetune --use-checkpoint-args under TP=2 with sequence parallelism, DP=2 and PP=2 trains as one process
does: losses and step-1 gradients to 1e-5, from the Llama-style checkpoint (GQA, SwiGLU, QK-norm) and from
Megatron's GPT defaults (LayerNorm, biases, tied; RoPE or its learned position table), continued as an AR
model and adapted to a DLM with an appended mask token; and mixtures of experts under expert parallelism
(EP=2), in every layer or after a dense one with a shared expert; and checkpoints saved with megatron-core's
singleton_local_shards metadata (experts and SwiGLU halves under their own keys). Each rank reads only its pieces
(megatron_lm_checkpoint.megatron_lm_pieces), so a wrong slice (a tensor-parallel fc1's gate and up rows, a
stage's layers, an expert-parallel rank's experts) shows in the losses."""

from pathlib import Path

import pytest

from tests.distributed.parity import LayoutCases

pytestmark = pytest.mark.distributed

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "megatron"
BASE = ["--use-checkpoint-args", "--finetune", "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by",
        "1", "--seq-length", "16", "--lr", "1e-3", "--log-interval", "1000", "--eval-iters", "0",
        "--attention-backend", "math", "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
# The DLM's mask row is new (drawn whole, then sliced): its padded vocabulary is 128 in every layout, so
# it starts equal everywhere; the AR runs keep the checkpoint's 64 rows.
MODES = {"ar": ["--model-running-mode", "vanilla"],
         "dlm": ["--model-running-mode", "difflm-noshift", "--add-mask-token", "--make-vocab-size-divisible-by", "64"]}
# legacy_*: Megatron-LM's legacy torch format, two tensor-parallel ranks' files joined (megatron_lm_legacy.py);
# legacy_gpt_*: its older GPT model's (megatron/legacy/model: `language_model.*`); megatron_lm_*: Megatron-LM's
# own save_checkpoint wrote it
CASES = [("dense", "ar", ()), ("dense", "dlm", ()), ("dense_gpt", "ar", ()), ("legacy_dense_tp2_pp1", "dlm", ()),
         ("dense_gpt_learned", "dlm", ()), ("dense_singleton", "ar", ()), ("legacy_gpt_tp2_pp1", "dlm", ()),
         ("megatron_lm_torch_dist", "dlm", ())]
SUITE = LayoutCases({"tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], CASES, False),
                     "dp2": (2, [], CASES, True),
                     "pp2": (2, ["--pipeline-model-parallel-size", "2"], CASES, False),
                     # megatron-core's MoE checkpoint, its 4 experts split over 2 expert-parallel ranks
                     "ep2": (2, ["--expert-model-parallel-size", "2"],
                             [("moe", "dlm", ()), ("moe_mixed_shared", "ar", ()), ("moe_singleton", "dlm", ()),
                              ("legacy_moe_tp1_pp1_ep2", "ar", ())],
                             False)},
                    lambda case, mode, extra: ["--load", str(ASSETS / case)] + BASE + MODES[mode])

references = SUITE.references_fixture()


def test_a_megatron_checkpoint_trains_on_in_every_layout_as_in_one_process(references, tmp_path):
    assert SUITE.check(2, references, tmp_path)
