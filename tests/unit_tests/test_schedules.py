"""The micro-batch schedule seam and the global-batch loss it fills."""

import pytest
import torch

from megatron.core.distributed.loss_normalization import GlobalBatchLoss
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    batches = [torch.randn(3, 4) for _ in range(3)]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])]

    def forward_step(iterator, model, microbatch):
        inputs, mask = next(iterator)
        output = model(inputs).squeeze(-1) ** 2 * mask
        return output, lambda out: (out.sum(), mask.sum())

    return model, list(zip(batches, masks)), forward_step


def test_micro_batches_sum_their_losses_and_normalizers_and_backpropagate_the_sums():
    model, data, forward_step = _setup()
    loss = forward_backward_no_pipelining(forward_step, iter(data), model, 3, GlobalBatchLoss(torch.device("cpu")))
    expected_sum = sum((model(x).squeeze(-1) ** 2 * m).sum() for x, m in data)
    assert torch.allclose(loss.loss_sum, expected_sum.double()) and loss.normalizer.item() == 6.0
    grads = model.weight.grad.clone()
    model.zero_grad()
    expected_sum.backward()  # the sum, not a per-micro-batch mean
    torch.testing.assert_close(grads, model.weight.grad)
    assert torch.allclose(loss.reduce().loss, expected_sum.double() / 6.0)
    assert loss.gradient_scale(replicas=2).item() == pytest.approx(2 / 6)


def test_forward_only_leaves_no_gradients_and_the_scale_needs_a_reduced_loss():
    model, data, forward_step = _setup()
    loss = forward_backward_no_pipelining(forward_step, iter(data), model, 3, GlobalBatchLoss(torch.device("cpu")),
                                          forward_only=True)
    assert model.weight.grad is None
    with pytest.raises(RuntimeError, match="before reduce"):
        loss.gradient_scale(1)


def test_pipeline_schedules_are_chosen_by_the_layout():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    with pytest.raises(ValueError, match="a pipeline of 2 stages needs this rank's PipelineLinks"):
        get_forward_backward_func(2)
