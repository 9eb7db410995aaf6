"""The block-size curriculum (--difflm-block-size-schedule): its flag, the size of each step, what it
refuses, and a forward of the scheduled size computing what a model of that size computes (resume
across a change: test_checkpoint_resume.py; every layout: test_block_diffusion_parity.py)."""

import argparse

import pytest
import torch

from custom_args.difflm import add_difflm_args, block_size_schedule
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.arguments import parse_args
from tests.unit_tests.test_training import TINY

MASK = 63


def test_the_flag_reads_iteration_size_pairs():
    assert block_size_schedule("0:1,2000:4,4000:32") == ((0, 1), (2000, 4), (4000, 32))
    for bad in ("0-1", "0:1,2000", "a:4", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="ITER:SIZE"):
            block_size_schedule(bad)


def test_each_step_trains_with_the_last_entry_at_or_before_it():
    cfg = DLMConfig(mask_token_id=MASK, block_diffusion=True, block_size=1,
                    block_size_schedule=((0, 1), (3, 4), (5, 8))).validate(seq_length=16)
    assert [cfg.block_size_at(step) for step in range(7)] == [1, 1, 1, 4, 4, 8, 8]
    assert cfg.at_iteration(4).block_size == 4 and cfg.at_iteration(4).block_size_schedule == cfg.block_size_schedule
    plain = DLMConfig(mask_token_id=MASK, block_diffusion=True, block_size=4)
    assert plain.at_iteration(10) is plain and plain.block_size_at(10) == 4  # no schedule: no copy, no change


@pytest.mark.parametrize("changes,message", [
    (dict(block_size_schedule=((1, 4),)), "must start at iteration 0"),
    (dict(block_size_schedule=((0, 4), (5, 8), (5, 16))), "must start at iteration 0 and increase"),
    (dict(block_size_schedule=((0, 4), (5, 6))), "the block size 6 \\(from iteration 5\\) must be a positive divisor"),
    (dict(block_diffusion=False, block_size_schedule=((0, 4),)), "needs block diffusion or block_causal"),
])
def test_a_bad_schedule_names_what_to_fix(changes, message):
    cfg = DLMConfig(**{"mask_token_id": MASK, "block_diffusion": True, "block_size": 4, **changes})
    with pytest.raises(ValueError, match=message):
        cfg.validate(seq_length=16)


def test_the_flags_build_the_schedule_and_its_first_size(capsys):
    base = TINY + ["--train-iters", "1", "--seq-length", "32"]
    args = parse_args(base + ["--difflm-block-diffusion", "--difflm-block-size-schedule", "0:4,10:8"],
                      add_difflm_args, world_size=1)
    assert args.dlm_config.block_size_schedule == ((0, 4), (10, 8)) and args.dlm_config.block_size == 4
    with pytest.raises(SystemExit):
        parse_args(base + ["--difflm-block-size-schedule", "0:4,10:8"], add_difflm_args, world_size=1)
    assert "--attention-mask-type block_causal or --difflm-block-diffusion" in capsys.readouterr().err


@pytest.mark.parametrize("block_diffusion", [True, False])
def test_a_forward_of_the_scheduled_size_is_a_model_of_that_size(block_diffusion):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                               attention_backend="math")
    mask = {} if block_diffusion else {"attention_mask_type": "block_causal"}

    def model(size):
        torch.manual_seed(0)
        return GPTModel(config, DLMConfig(mask_token_id=MASK, block_diffusion=block_diffusion, block_size=size, **mask))

    ids = torch.randint(0, MASK, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, MASK, (2, 16), generator=torch.Generator().manual_seed(2))
    small, large = model(4), model(8)
    scheduled, _ = small(ids, labels=labels, block_size=8)
    expected, _ = large(ids, labels=labels)
    own, _ = small(ids, labels=labels)
    torch.testing.assert_close(scheduled, expected, rtol=0, atol=0)
    assert not torch.allclose(own, expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_layers_follow_each_scheduled_size(device):
    """The launch scripts compile the layers: a size change reaches the compiled attention (a new block
    mask, no stale graph), losses and gradients as eager's, sizes going up and back down."""
    from megatron.core.transformer.compilation import compile_transformer_layers
    from tests.unit_tests.test_compilation import inductor_available

    if device == "cpu" and not inductor_available():
        pytest.skip("torch.compile (inductor) cannot build CPU kernels here")
    # head dim 16: compiled FlexAttention (CUDA's auto backend for this mask) needs at least 16
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                               vocab_size=64, attention_backend="auto")
    dlm = DLMConfig(mask_token_id=MASK, block_diffusion=True, block_size=4)
    ids = torch.randint(0, MASK, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    labels = torch.randint(0, MASK, (2, 32), generator=torch.Generator().manual_seed(2)).to(device)
    models = []
    for compiled in (False, True):
        torch.manual_seed(0)
        models.append(GPTModel(config, dlm).to(device).train())
        if compiled:
            assert compile_transformer_layers(models[-1]) == 2
    for size in (4, 8, 4, 16):
        results = []
        for model in models:
            model.zero_grad(set_to_none=True)
            _, loss = model(ids, labels=labels, block_size=size)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        (expected_loss, expected), (got_loss, got) = results
        torch.testing.assert_close(got_loss, expected_loss, rtol=1e-5, atol=0, msg=f"block size {size}")
        for grad, reference in zip(got, expected):
            torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-5 * reference.abs().max().item())
