"""megatron/rl/objectives.py against hand-computed values: GRPO's group advantages, PPO's clipped ratio
(each side of the clip, both advantage signs), the k3 KL estimate, and the two normalizations."""

import math

import pytest
import torch

from megatron.rl import objectives


def test_group_advantages_centre_and_scale_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    advantages = objectives.group_advantages(rewards, group_size=4)
    std = math.sqrt((4 * 0.25) / 3)  # Bessel-corrected spread of {1, 0, 0, 1}
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    torch.testing.assert_close(advantages[:4], expected)
    assert torch.equal(advantages[4:], torch.zeros(4))  # all equal: no signal
    centred = objectives.group_advantages(rewards, group_size=4, scale=False)
    assert centred.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 3"):
        objectives.group_advantages(rewards, group_size=3)


@pytest.mark.parametrize("ratio, advantage, loss, clipped", [
    (1.5, 1.0, -1.2, True),    # above 1 + 0.2 with A > 0: capped
    (1.5, -1.0, 1.5, False),   # above with A < 0: the unclipped (worse) term, its gradient kept
    (0.5, 1.0, -0.5, False),   # below 1 - 0.2 with A > 0: unclipped
    (0.5, -1.0, 0.8, True),    # below with A < 0: floored at 0.8
])
def test_the_clipped_surrogate_takes_the_pessimistic_side(ratio, advantage, loss, clipped):
    logp = torch.tensor([[math.log(ratio)]])
    per_token, was_clipped = objectives.clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([advantage]))
    assert per_token.item() == pytest.approx(loss) and bool(was_clipped) == clipped


def test_one_inner_step_gives_the_plain_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    per_token, _ = objectives.clipped_surrogate(logp, logp.detach(), advantages)
    per_token.sum().backward()
    assert torch.equal(logp.grad, -advantages[:, None].expand(2, 2))


def test_k3_is_zero_where_the_policies_agree_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -1.0, -3.0])
    kl = objectives.kl_k3(logp, torch.tensor([-1.0, -2.0, -1.0]))
    assert kl[0] == 0 and kl[1].item() == pytest.approx(math.exp(-1) + 1 - 1)
    assert kl[2].item() == pytest.approx(math.exp(2) - 2 - 1)


def test_sequence_and_token_normalizations_of_the_policy_loss():
    logp = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -1.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([1.0, -2.0])
    ref = torch.tensor([[-1.5, -2.0, -4.0], [-0.5, -1.0, 0.0]])
    beta = 0.1
    per_token = -advantages[:, None] + beta * objectives.kl_k3(logp, ref)  # ratio 1: no clipping
    loss, normalizer, stats = objectives.policy_loss(logp, logp.detach(), advantages, mask, ref, beta=beta)
    expected = per_token[0].mean() + per_token[1, :2].mean()
    assert normalizer.item() == 2 and loss.item() == pytest.approx(expected.item())
    loss, normalizer, _ = objectives.policy_loss(logp, logp.detach(), advantages, mask, ref, beta=beta,
                                                 normalization="token")
    assert normalizer.item() == 5 and loss.item() == pytest.approx((per_token * mask).sum().item())
    assert stats["clip fraction"] == 0 and stats["ratio"] == 1
    assert stats["kl"].item() == pytest.approx((objectives.kl_k3(logp, ref) * mask).sum().item() / 5)
    with pytest.raises(ValueError, match="normalization 'tokens'"):
        objectives.policy_loss(logp, logp, advantages, mask, normalization="tokens")
