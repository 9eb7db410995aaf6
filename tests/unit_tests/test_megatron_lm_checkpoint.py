"""Megatron-LM's torch_dist checkpoints read as they are: tiny GPT models that megatron-core itself built and
saved (tests/assets/megatron/make_assets.py: its local layer spec, one process and TP=2 / PP=2 layouts) load
into our GPTModel, whose logits then equal the ones megatron-core computed for the same ids (fp32)."""

import argparse
from pathlib import Path

import pytest
import torch

from custom_args.difflm import add_difflm_args
from megatron.core.errors import InputError
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.training.megatron_lm_checkpoint import (megatron_lm_flags, megatron_lm_iteration_dir,
                                                      read_megatron_lm_args, read_megatron_lm_weights)
from megatron.training.run_config import parse_run_config

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "megatron"
RUN = ["--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "1", "--seq-length", "32",
       "--model-running-mode", "vanilla", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
       "--train-iters", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--attention-backend", "math"]


def load(case: str) -> GPTModel:
    folder = megatron_lm_iteration_dir(str(ASSETS / case))
    args = read_megatron_lm_args(folder)
    config = parse_run_config(megatron_lm_flags(args) + RUN, add_difflm_args, world_size=1)
    model = GPTModel(config.model, config.dlm)
    model.load_state_dict(read_megatron_lm_weights(folder, args.num_layers), strict=True)
    return model.eval()


@pytest.mark.parametrize("case, reference", [("dense", "dense"), ("dense_gpt", "dense_gpt"),
                                             ("dense_tp2_pp1", "dense"), ("dense_tp1_pp2", "dense")])
def test_our_logits_equal_megatron_cores(case, reference):
    """The Llama style (GQA, QK-norm, SwiGLU, RMSNorm, RoPE, untied) and Megatron's GPT defaults (LayerNorm,
    GeLU, biases, learned positions, tied); the TP=2 and PP=2 saves of the first join to the same model."""
    expected = torch.load(ASSETS / reference / "logits.pt")
    model = load(case)
    with torch.no_grad():
        logits = model(expected["tokens"])
    torch.testing.assert_close(logits.float(), expected["logits"], rtol=1e-5, atol=1e-5)


def test_the_args_come_from_common_pt_and_code_is_never_run(tmp_path):
    args = read_megatron_lm_args(megatron_lm_iteration_dir(str(ASSETS / "dense")))
    assert (args.num_layers, args.num_query_groups, args.swiglu, args.ckpt_format) == (2, 2, True, "torch_dist")
    crafted = tmp_path / "iter_0000001"
    crafted.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    (crafted / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"args": argparse.Namespace(num_layers=2), "hook": _Evil()}, crafted / "common.pt")
    with pytest.raises(InputError, match="cannot be read safely"):
        read_megatron_lm_args(str(crafted))


class _Evil:
    def __reduce__(self):
        return (print, ("this would run on load",))
