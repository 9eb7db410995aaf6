"""megatron/rl/spg.py: SPG's block-wise masks, its lower and upper bounds against a hand computation, and
its update through the training schedule equal to the bounds computed from a direct forward."""

import math

import pytest
import torch

from megatron.core.distributed.loss_normalization import GlobalBatchLoss
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.rl import spg
from megatron.rl.step import RLConfig, RolloutBatch, rl_forward_step
from tests.unit_tests.test_gpt_model import MASK_ID, build, tokens

P, T = 3, 8


def test_each_sample_hides_part_of_one_block_and_everything_after():
    completion = torch.tensor([[True] * 8, [True] * 5 + [False] * 3, [True] + [False] * 7])
    generators = [torch.Generator().manual_seed(seed) for seed in (4, 5, 6)]
    hidden = spg.spg_masks(completion, samples=3, block_length=3, generators=generators).view(3, 3, T)
    for sample in range(3):
        for row, length in enumerate((8, 5, 1)):
            positions = hidden[sample, row].nonzero()[:, 0].tolist()
            first = positions[0]
            block_end = min((first // 3 + 1) * 3, length)
            assert positions[0] < length  # at least one scored token
            assert all(p in positions for p in range(block_end, T))  # the rest of the canvas hidden
            assert 1 <= sum(p < block_end for p in positions) <= block_end - first // 3 * 3  # part of one block
    again = spg.spg_masks(completion[1:2], 3, 3, [torch.Generator().manual_seed(5)]).view(3, 1, T)
    assert torch.equal(again[:, 0], hidden[:, 1])  # a row's masks follow its own seed, not its batch


def test_the_visible_tokens_are_masked_with_the_prompt_probability():
    """SPG's reference masks the tokens its block masks leave visible (the prompt, the completion before the
    block) with p_mask_prompt; a hidden earlier completion token is scored; the block masks stay the draws
    they were."""
    rows, samples = 64, 2
    sequence = tokens(batch=rows, seq=P + T, seed=3)
    completion = torch.ones(rows, T, dtype=torch.bool)
    completion[::2, 6:] = False
    seeds = list(range(100, 100 + rows))
    clean = spg.spg_batch(sequence, P, MASK_ID, completion, samples, 3, seeds)
    hidden_clean = clean.input_ids == MASK_ID
    assert not hidden_clean[:, :P].any()  # no visible token masked
    for probability in (1.0, 0.3):
        masked = spg.spg_batch(sequence, P, MASK_ID, completion, samples, 3, seeds, prompt_mask_prob=probability)
        hidden = masked.input_ids == MASK_ID
        assert (hidden & hidden_clean).equal(hidden_clean)  # the block masks as they were, more tokens hidden
        extra = hidden & ~hidden_clean
        scored = torch.cat([torch.zeros(samples * rows, P, dtype=torch.bool), completion.repeat(samples, 1)], dim=1)
        assert torch.equal(masked.loss_weights > 0, hidden & scored)  # earlier completion tokens hidden: scored
        visible = ~hidden_clean
        share = extra.sum().item() / visible.sum().item()
        if probability == 1.0:
            assert torch.equal(extra, visible) and extra[:, P:].any()
        else:
            assert abs(share - 0.3) < 0.05, share  # about 0.3 of the visible tokens, prompt and completion
            assert extra[:, :P].any() and extra[:, P:].any()


def hand_bounds(logp, scored, lengths, beta):
    """The bounds written out token by token."""
    samples, rows, width = logp.shape
    lower, upper = [], []
    for i in range(rows):
        means = []
        for j in range(samples):
            picked = [logp[j, i, k].item() for k in range(width) if scored[j, i, k]]
            means.append(sum(picked) / max(len(picked), 1))
        lower.append(sum(means) / samples)
        logs = []
        for k in range(width):
            total = 0.0
            for j in range(samples):
                t = sum(bool(scored[j, i, m]) for m in range(width)) / lengths[i]
                if scored[j, i, k]:
                    total += math.exp(beta * logp[j, i, k].item()) / t
            if total > 0:
                logs.append(math.log(total / samples))
        upper.append(sum(logs) / max(len(logs), 1) / beta)
    return torch.tensor(lower, dtype=torch.float64), torch.tensor(upper, dtype=torch.float64)


def test_the_bounds_and_the_loss_equal_a_hand_computation():
    generator = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 3, 5, generator=generator, dtype=torch.float64) * 3
    scored = torch.rand(2, 3, 5, generator=generator) < 0.5
    scored[:, :, 0] = True
    completion = torch.tensor([[True] * 5, [True] * 4 + [False], [True] * 2 + [False] * 3])
    scored &= completion[None]
    lower, upper = spg.sequence_bounds(logp, scored, completion, beta=1.5)
    expected_lower, expected_upper = hand_bounds(logp, scored, [5, 4, 2], 1.5)
    torch.testing.assert_close(lower, expected_lower)
    torch.testing.assert_close(upper, expected_upper)
    advantages = torch.tensor([1.0, -0.5, -2.0], dtype=torch.float64)
    loss_sum, normalizer = spg.spg_loss(logp, scored, completion, advantages, beta=1.5, mix=0.25)
    bound = [expected_lower[0], 0.25 * expected_upper[1] + 0.75 * expected_lower[1],
             0.25 * expected_upper[2] + 0.75 * expected_lower[2]]
    expected = sum(-a * b * n for a, b, n in zip(advantages.tolist(), bound, (5, 4, 2)))
    assert normalizer.item() == 11 and loss_sum.item() == pytest.approx(float(expected), rel=1e-12)


def test_the_update_through_the_schedule_equals_the_direct_bounds():
    """Two micro-batches through the schedule: the loss and gradients of the bounds of one direct forward."""
    config = RLConfig(estimator="spg", mask_token_id=MASK_ID, spg_samples=2, spg_block_length=3).validate()
    sequence = tokens(batch=4, seq=P + T, seed=9)
    completion = torch.ones(4, T, dtype=torch.bool)
    completion[1, 5:] = False
    advantages, seeds = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([11, 12, 13, 14])
    model = build()
    batches = [RolloutBatch(sequence[r], P, completion[r], advantages[r], None, seeds[r])
               for r in (slice(0, 2), slice(2, 4))]
    reduced = forward_backward_no_pipelining(lambda it, m, _: rl_forward_step(next(it), m, config), iter(batches),
                                             model, 2, GlobalBatchLoss(torch.device("cpu")))
    through = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    estimate = spg.spg_batch(sequence, P, MASK_ID, completion, 2, 3, seeds.tolist(),
                             prompt_mask_prob=config.prompt_mask_prob)  # 0.15 (d1's)
    per_token = model.difflm_forward(estimate.input_ids, labels=estimate.labels, loss_weights=estimate.loss_weights,
                                     loss_normalizer=1.0)[0]
    logp = (-per_token * estimate.loss_weights)[:, P:].view(2, 4, T)
    scored = (estimate.loss_weights[:, P:] > 0).view(2, 4, T)
    loss_sum, normalizer = spg.spg_loss(logp, scored, completion, advantages, beta=1.5, mix=0.5)
    (loss_sum / normalizer).backward()
    assert float(reduced.normalizer) == float(normalizer) == 4 * T - 3
    assert reduced.loss.item() == pytest.approx((loss_sum / normalizer).item(), rel=1e-5)
    for name, p in model.named_parameters():  # the loop divides the summed gradients once, by the normalizer
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(through[name] / float(normalizer), p.grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
