"""megatron/rl/estimators.py against references computed from the model's logits (inference_forward
with explicitly written masks): exact AR log-probabilities, d1's one-step estimate, coupled-GRPO's
complementary pair; each differentiable."""

import pytest
import torch

from megatron.rl import estimators
from tests.unit_tests.test_block_diffusion import paper_mask
from tests.unit_tests.test_gpt_model import MASK_ID, build, dlm_config, tiny_config, tokens

P, T = 5, 7


def logp_of(model, ids, mask, targets, positions=None):
    """log p(targets) at every position of `ids` under the explicit [B, L, L] visibility `mask`."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1) if positions is None else positions
    logits = model.inference_forward(ids, positions, mask).float()
    return logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]


def test_ar_log_probabilities_are_the_causal_next_token_ones():
    model = build(config=tiny_config(init_method_std=0.5), dlm=dlm_config(model_running_mode="vanilla"))
    sequence = tokens(batch=3, seq=P + T)
    ours = estimators.ar_logprobs(model, sequence, P)
    causal = torch.ones(P + T, P + T, dtype=torch.bool).tril().expand(3, -1, -1)
    reference = logp_of(model, sequence, causal, torch.roll(sequence, -1, dims=1))[:, P - 1:-1]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert ours.requires_grad


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift"])
def test_the_one_step_estimate_masks_the_completion_and_some_prompt_tokens(mode):
    model = build(config=tiny_config(init_method_std=0.5), dlm=dlm_config(model_running_mode=mode))
    sequence = tokens(batch=3, seq=P + T)
    ours = estimators.diffu_grpo_logprobs(model, sequence, P, MASK_ID, prompt_mask_prob=0.4,
                                          seeds=[7, 8, 9])
    # the token d places before the completion takes the row's d-th draw (independent of left padding)
    draw = torch.stack([torch.rand(P, generator=torch.Generator().manual_seed(seed)).flip(0) for seed in (7, 8, 9)])
    noisy = sequence.clone()
    noisy[:, :P][draw < 0.4] = MASK_ID
    noisy[:, P:] = MASK_ID
    assert (draw < 0.4).any() and not (draw < 0.4).all()
    everything = torch.ones(3, P + T, P + T, dtype=torch.bool)
    if mode == "difflm-shift":  # position i scores token i + 1
        reference = logp_of(model, noisy, everything, torch.roll(sequence, -1, dims=1))[:, P - 1:-1]
    else:
        reference = logp_of(model, noisy, everything, sequence)[:, P:]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    ours.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_coupled_pair_scores_each_token_once_under_the_mask_that_hides_it():
    model = build(config=tiny_config(init_method_std=0.5), dlm=dlm_config())
    sequence = tokens(batch=2, seq=P + T)
    ours = estimators.coupled_logprobs(model, sequence, P, MASK_ID, seeds=[3, 4])
    generators = [torch.Generator().manual_seed(seed) for seed in (3, 4)]  # the same draws, written out
    t = 0.2 + 0.6 * torch.stack([torch.rand(1, generator=row) for row in generators])
    ranks = torch.stack([torch.rand(T, generator=row) for row in generators]).argsort(dim=1).argsort(dim=1)
    first = ranks < (t * T).round()
    everything = torch.ones(2, P + T, P + T, dtype=torch.bool)
    expected = torch.zeros(2, T)
    for hidden in (first, ~first):
        noisy = sequence.clone()
        noisy[:, P:][hidden] = MASK_ID
        expected += torch.where(hidden, logp_of(model, noisy, everything, sequence)[:, P:], 0.0)
    assert first.any() and (~first).any()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2 .?tokens or more"):
        estimators.coupled_logprobs(model, sequence[:, :P + 1], P, MASK_ID)


@pytest.mark.parametrize("estimator", ["diffu_grpo", "coupled"])
def test_a_rows_estimate_does_not_depend_on_the_rows_beside_it(estimator):
    """Keyed by the row's seed: one batch of 4 or two of 2 (other micro-batches, other replicas) agree."""
    model = build(config=tiny_config(init_method_std=0.5), dlm=dlm_config())
    sequence, seeds = tokens(batch=4, seq=P + T), [21, 22, 23, 24]
    run = estimators.coupled_logprobs if estimator == "coupled" else estimators.diffu_grpo_logprobs
    whole = run(model, sequence, P, MASK_ID, seeds=seeds)
    halves = torch.cat([run(model, sequence[:2], P, MASK_ID, seeds=seeds[:2]),
                        run(model, sequence[2:], P, MASK_ID, seeds=seeds[2:])])
    torch.testing.assert_close(whole, halves, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ar_loss_weight", [0.0, 1.0], ids=["block_diffusion", "joint"])
def test_ar_order_reads_each_token_given_the_clean_tokens_before_it(ar_loss_weight):
    """A block-diffusion policy at blocks of 1: the masked completion token j sees itself and the clean
    tokens before it (the clean half causal within a block of 1 either way), so one forward gives the
    exact left-to-right log p(y_j | prompt, y_<j)."""
    model = build(config=tiny_config(init_method_std=0.5),
                  dlm=dlm_config(block_diffusion=True, block_size=4, ar_loss_weight=ar_loss_weight))
    sequence = tokens(batch=2, seq=P + T)
    ours = estimators.ar_order_logprobs(model, sequence, P, MASK_ID)
    length = P + T
    noisy = sequence.clone()
    noisy[:, P:] = MASK_ID
    allowed = paper_mask(length, 1)  # BD3's rule at blocks of 1: the clean half causal either way
    both = torch.cat([noisy, sequence], dim=1)
    positions = torch.arange(length).repeat(2).expand(2, -1)  # [x_t ; x_0] repeats the positions
    reference = logp_of(model, both, allowed.expand(2, -1, -1), torch.cat([sequence, sequence], dim=1),
                        positions)[:, P:length]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_an_estimator_the_policy_cannot_serve_is_refused():
    plain = build(dlm=dlm_config())
    with pytest.raises(ValueError, match="not a block-diffusion model"):
        estimators.ar_order_logprobs(plain, tokens(batch=1, seq=P + T), P, MASK_ID)
    with pytest.raises(ValueError, match="reads a causal forward"):
        estimators.ar_logprobs(plain, tokens(batch=1, seq=P + T), P)
    with pytest.raises(ValueError, match="an autoregressive one uses ar"):
        estimators.diffu_grpo_logprobs(build(dlm=dlm_config(model_running_mode="vanilla")), tokens(batch=1, seq=P + T),
                                       P, MASK_ID)
