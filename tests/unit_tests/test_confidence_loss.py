"""LLaDA 2.0's confidence-aware loss (--difflm-confidence-loss-weight): the entropy and argmax of
vocab-sharded logits against the full softmax, the loss and its gradients against a hand-computed
reference (the diffusion loss plus lambda times the entropies at the correctly predicted masked
positions), with the joint AR + DLM objective, its logged term, and the refusals (every layout:
tests/distributed/test_block_diffusion_parity.py)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.difflm import objective
from megatron.core.tensor_parallel import vocab_parallel_confident_entropy
from tests.unit_tests.test_bad_inputs_training import TINY as BAD_TINY, parse_error
from tests.unit_tests.test_gpt_model import MASK_ID, build, dlm_config, tiny_config, tokens
from tests.unit_tests.test_joint_ar_loss import joint_mask
from tests.unit_tests.test_training import make_trainer

LAMBDA, L = 0.4, 16


def entropy_reference(logits: torch.Tensor) -> torch.Tensor:
    p = logits.float().softmax(-1)
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)


def test_entropy_and_argmax_equal_the_full_softmax_with_padding_columns():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 13, generator=generator, dtype=torch.float32) * 3
    logits[..., -2:] = float("-inf")  # vocabulary padding, never predicted
    targets = torch.randint(0, 11, (3, 7), generator=generator)
    targets[0] = logits[0, :, :11].argmax(-1)  # a row predicted right everywhere
    leaf = logits.clone().requires_grad_(True)
    entropy, correct = vocab_parallel_confident_entropy(leaf, targets, None)
    reference_leaf = logits[..., :11].clone().requires_grad_(True)
    reference = entropy_reference(reference_leaf)
    torch.testing.assert_close(entropy, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(correct, logits.argmax(-1) == targets) and correct[0].all() and not correct.all()
    grad = torch.randn(3, 7, generator=generator)
    (mine,) = torch.autograd.grad((entropy * grad).sum(), leaf)
    (theirs,) = torch.autograd.grad((reference * grad).sum(), reference_leaf)
    torch.testing.assert_close(mine[..., :11], theirs, rtol=1e-4, atol=1e-6)
    assert (mine[..., 11:] == 0).all()


def reference_loss(model, corruption, x0, logits, normalizer):
    vocab = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, vocab), x0.reshape(-1), reduction="none").view(x0.shape)
    masked = corruption.masked_positions
    diffusion = (ce * masked / corruption.p_mask).sum() / normalizer
    right = masked & (logits.argmax(-1) == x0)
    confidence = LAMBDA * (entropy_reference(logits) * right).sum() / normalizer
    return diffusion, confidence


def forward_logits(model, noisy, x0, joint):
    """The noisy positions' logits [b, L, V] and, for the joint model, the full [x_t ; x_0] ones."""
    if not joint:
        return model(noisy).float(), None
    both = torch.cat([noisy, x0], dim=1)
    hidden = model._run(both, torch.arange(L).repeat(2).expand(3, 2 * L), None, None,
                        objective_mask(joint_mask(L, 4).expand(3, 2 * L, 2 * L)), None)
    full = model.head.logits(hidden, model._output_weight()).float()
    return full[:, :L], full


@pytest.mark.parametrize("joint", [False, True], ids=["mdlm", "block_diffusion_joint_ar"])
def test_the_loss_and_its_gradients_equal_a_hand_computed_reference(joint):
    changes = dict(block_diffusion=True, block_size=4, ar_loss_weight=0.5) if joint else {}
    # init std 0.5: varied predictions at masked positions (a 0.02 init predicts the mask token everywhere)
    model = build(config=tiny_config(init_method_std=0.5), dlm=dlm_config(confidence_loss_weight=LAMBDA, **changes))
    x0 = tokens(batch=3, seq=L)
    first = objective.compute_loss(model, x0).corruption
    # Half the masked tokens become what the model predicts there (the masks are keyed by position, not by
    # value, so the same positions stay masked): some predictions are right, others wrong.
    with torch.no_grad():
        guess = forward_logits(model, first.noisy_input_ids, x0, joint)[0].argmax(-1)
    pick = first.masked_positions & (torch.arange(L) % 2 == 0) & (guess != MASK_ID)
    x0 = torch.where(pick, guess, x0)
    ours = objective.compute_loss(model, x0)
    assert torch.equal(ours.corruption.masked_positions, first.masked_positions)
    assert set(ours.terms) == ({"ar loss", "confidence loss"} if joint else {"confidence loss"})
    logits, full = forward_logits(model, ours.corruption.noisy_input_ids, x0, joint)
    extra = 0.0
    if joint:  # the AR term as test_joint_ar_loss computes it
        next_ce = F.cross_entropy(full[:, L:2 * L - 1].reshape(-1, full.shape[-1]), x0[:, 1:].reshape(-1),
                                  reduction="sum")
        extra = 0.5 * next_ce / (3 * L)
    diffusion, confidence = reference_loss(model, ours.corruption, x0, logits, 3 * L)
    expected = diffusion + confidence + extra
    torch.testing.assert_close(ours.terms["confidence loss"], confidence.detach(), rtol=1e-5, atol=1e-7)
    assert confidence > 0 and ((logits.argmax(-1) != x0) & first.masked_positions).any()  # right and wrong
    torch.testing.assert_close(ours.loss, expected, rtol=1e-5, atol=1e-7)
    params = [p for p in model.parameters() if p.requires_grad]
    mine = torch.autograd.grad(ours.loss, params)
    theirs = torch.autograd.grad(expected, params)
    for got, want in zip(mine, theirs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def objective_mask(allowed):
    from megatron.core.transformer.attention_mask import AttentionMask

    return AttentionMask("explicit", allowed=allowed)


def test_training_logs_the_confidence_term(runtime):
    trainer = make_trainer(runtime, "--difflm-confidence-loss-weight", str(LAMBDA), "--train-iters", "2",
                           "--micro-batch-size", "4", "--global-batch-size", "8")
    trainer.train()
    for result in trainer.history:
        assert set(result.parts) == {"diffusion loss", "confidence loss"} and result.parts["confidence loss"] >= 0
        assert sum(result.parts.values()) == pytest.approx(result.loss, rel=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["--difflm-confidence-loss-weight", "0.5", "--difflm-masked-only-loss"], "drop masked_only_loss"),
    (["--difflm-confidence-loss-weight", "-0.5"], ">= 0"),
])
def test_bad_confidence_flags_are_one_line(extra, message, capsys):
    assert message in parse_error(BAD_TINY + extra, capsys)
