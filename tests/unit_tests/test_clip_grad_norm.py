"""Gradient clipping in one process: the global norm and the clipped gradients equal torch's."""

import pytest
import torch

from megatron.core.optimizer.optimizer import clip_grad_norm, folds_gradient_scale, forget_gradient_scale


def parameters_with_grads(seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((7, 5), (11,), (3, 4, 2))]
    for param in params:
        param.grad = scale * torch.randn(param.shape, generator=generator)
    params[1].tensor_model_parallel = True  # a tp shard counts once in one process, like the rest
    return params


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_norm_and_clipping_match_torch(max_norm):
    ours, reference = parameters_with_grads(), parameters_with_grads()
    norm = clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.grad, b.grad)


def test_zero_max_norm_reports_without_clipping():
    params = parameters_with_grads(scale=10.0)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 0.0)
    assert norm > 10.0
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_scale_and_clip_folded_into_a_fused_adamw_step_equal_multiplying_first(max_norm):
    """The loss normalizer and the clip coefficient handed to a fused AdamW (its grad_scale)
    give the weights of scaling the gradients, clipping them with torch and stepping."""
    scale = torch.tensor(1 / 37.0)
    results = []
    for folded in (True, False):
        params = parameters_with_grads(seed=3, scale=5.0)
        # eps of the gradients' order: Adam's update then depends on their scale, not only their sign.
        optimizer = torch.optim.AdamW(params, lr=0.1, eps=0.1, fused=folded or None)
        if folded:
            before = [p.grad.clone() for p in params]
            norm = clip_grad_norm(params, max_norm, scale=scale, optimizer=optimizer)
            assert all(torch.equal(p.grad, g) for p, g in zip(params, before))  # left to the step
            optimizer.step()
            forget_gradient_scale(optimizer)
            assert not hasattr(optimizer, "grad_scale")
        else:
            for param in params:
                param.grad.mul_(scale)
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
        results.append((norm, [p.detach().clone() for p in params]))
    (norm, folded_params), (expected_norm, expected_params) = results
    torch.testing.assert_close(norm, expected_norm)
    for a, b in zip(folded_params, expected_params):
        torch.testing.assert_close(a, b)


def test_scale_without_a_fused_optimizer_multiplies_the_gradients_once():
    params, reference = parameters_with_grads(seed=4), parameters_with_grads(seed=4)
    optimizer = torch.optim.AdamW(params, lr=0.1, foreach=True)
    assert not folds_gradient_scale(optimizer)
    clip_grad_norm(params, 0.0, scale=torch.tensor(0.25), optimizer=optimizer)
    for a, b in zip(params, reference):
        torch.testing.assert_close(a.grad, 0.25 * b.grad)


def test_a_chain_of_compiled_steps_takes_the_scale_in_every_part():
    """ZeRO-1 with MoE chains two optimizers: the clip's scale goes to each part's step (and is
    dropped from each after it), which then equals multiplying first and stepping torch's AdamW."""
    from megatron.core.optimizer.compiled_adamw import CompiledAdamW
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    scale, results = torch.tensor(1 / 37.0), []
    for folded in (True, False):
        params = parameters_with_grads(seed=5, scale=5.0)
        kind = CompiledAdamW if folded else torch.optim.AdamW
        chain = ChainedOptimizer([kind(params[:2], lr=0.1, eps=0.1), kind(params[2:], lr=0.1, eps=0.1)])
        assert folds_gradient_scale(chain) == folded
        before = [p.grad.clone() for p in params]
        clip_grad_norm(params, 0.05, scale=scale, optimizer=chain)
        assert all(torch.equal(p.grad, g) for p, g in zip(params, before)) == folded
        chain.step()
        forget_gradient_scale(chain)
        assert not any(hasattr(part, "grad_scale") for part in chain.parts)
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
