"""Gradient clipping in one process: the global norm and the clipped gradients equal torch's."""

import pytest
import torch

from megatron.core.optimizer.optimizer import clip_grad_norm


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
