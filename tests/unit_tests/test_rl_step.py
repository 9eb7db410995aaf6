"""megatron/rl/step.py: a policy-gradient update run through the training schedule over two micro-batches
equals the policy loss of the whole batch computed directly (estimator, then objective), loss and
gradients, for the masking estimators of a DLM and the exact one of an AR policy."""

import pytest
import torch

from megatron.core.distributed.loss_normalization import GlobalBatchLoss
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.rl import estimators, objectives
from megatron.rl.step import RLConfig, RolloutBatch, rl_forward_step
from tests.unit_tests.test_gpt_model import MASK_ID, build, dlm_config, tiny_config, tokens

P, T = 4, 6


def rollouts(model, config, seeds):
    """Two micro-batches of 2 completions with their advantages and the sampling policy's log-probs."""
    sequence = tokens(batch=4, seq=P + T, seed=5)
    mask = torch.ones(4, T, dtype=torch.bool)
    mask[1, 4:] = False  # a completion that ended early
    advantages = objectives.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    batches = []
    for index in range(2):
        rows = slice(2 * index, 2 * index + 2)
        with torch.no_grad():
            old = direct_logp(model, config, sequence[rows], seeds[rows])
        batches.append(RolloutBatch(sequence[rows], P, mask[rows], advantages[rows], old - 0.1 * index, seeds[rows]))
    return batches


def direct_logp(model, config, sequence, seeds):
    if config.estimator == "ar":
        return estimators.ar_logprobs(model, sequence, P)
    if config.estimator == "ar_order":
        return estimators.ar_order_logprobs(model, sequence, P, MASK_ID)
    if config.estimator == "coupled":
        return estimators.coupled_logprobs(model, sequence, P, MASK_ID, seeds=seeds)
    return estimators.diffu_grpo_logprobs(model, sequence, P, MASK_ID, config.prompt_mask_prob, seeds)


@pytest.mark.parametrize("estimator, normalization", [("diffu_grpo", "sequence"), ("coupled", "token"),
                                                      ("ar", "sequence"), ("ar_order", "token")])
def test_the_scheduled_update_equals_the_whole_batch_policy_loss(estimator, normalization):
    policy = {"ar": dict(model_running_mode="vanilla"), "ar_order": dict(block_diffusion=True, block_size=2)}
    model = build(config=tiny_config(init_method_std=0.5), dlm=dlm_config(**policy.get(estimator, {}))).train()
    config = RLConfig(estimator=estimator, mask_token_id=MASK_ID, normalization=normalization,
                      clip_high=0.28).validate()
    batches = rollouts(model, config, seeds=torch.tensor([11, 12, 13, 14]))
    params = [p for p in model.parameters() if p.requires_grad]
    loss = forward_backward_no_pipelining(lambda data, chunk, _: rl_forward_step(next(data), chunk, config),
                                          iter(batches), model, 2, GlobalBatchLoss(torch.device("cpu")))
    scheduled = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    total = normalizer = 0.0
    for batch in batches:  # the same update written out: estimator, objective, one division at the end
        logp = direct_logp(model, config, batch.sequence, batch.seeds)
        part, count, _ = objectives.policy_loss(logp, batch.old_logp, batch.advantages, batch.completion_mask,
                                                clip_high=0.28, normalization=normalization)
        total, normalizer = total + part, normalizer + count
    (total / normalizer).backward()
    assert float(loss.normalizer) == float(normalizer) == (4 if normalization == "sequence" else 22)
    torch.testing.assert_close(loss.loss.float(), (total / normalizer).detach(), rtol=1e-6, atol=1e-7)
    for got, param in zip(scheduled, params):  # the loop divides the summed gradients once, by the normalizer
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(got / float(normalizer), param.grad, rtol=1e-5, atol=1e-5 * scale)


def test_the_step_refuses_an_estimator_the_policy_cannot_serve():
    model = build(dlm=dlm_config())
    config = RLConfig(estimator="ar_order", mask_token_id=MASK_ID).validate()
    batch = RolloutBatch(tokens(batch=1, seq=P + T), P, torch.ones(1, T, dtype=torch.bool), torch.ones(1),
                         torch.zeros(1, T), torch.tensor([1]))
    with pytest.raises(ValueError, match="not a block-diffusion model"):
        rl_forward_step(batch, model, config)


def test_context_parallelism_is_refused_with_one_line():
    from types import SimpleNamespace

    model = build(dlm=dlm_config())
    model.context = SimpleNamespace(active=True)  # a rank holding part of each sequence
    batch = RolloutBatch(tokens(batch=1, seq=P + T), P, torch.ones(1, T, dtype=torch.bool), torch.ones(1),
                         torch.zeros(1, T), torch.tensor([1]))
    with pytest.raises(ValueError, match="--context-parallel-size 1 for RL"):
        rl_forward_step(batch, model, RLConfig(mask_token_id=MASK_ID))


def test_bad_rl_settings_name_the_field():
    with pytest.raises(ValueError, match="estimator='grpo'"):
        RLConfig(estimator="grpo").validate()
    with pytest.raises(ValueError, match="normalization='tokens'"):
        RLConfig(normalization="tokens").validate()
