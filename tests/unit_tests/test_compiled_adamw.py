"""CompiledAdamW (--compile-optimizer-step) is torch's AdamW: the same weights and moments after
steps with a changing learning rate, weight decay groups and the clip's folded scale, the same
state_dict keys, and the flag reaches the training loop (under ZeRO-1 too)."""

import copy

import pytest
import torch

from megatron.core.optimizer.compiled_adamw import CompiledAdamW, adamw_update
from megatron.core.optimizer.optimizer import OptimizerConfig, build_optimizer, folds_gradient_scale, local_optimizers
from tests.unit_tests.test_training import make_trainer


def _twins(seed: int = 0):
    torch.manual_seed(seed)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    ours = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() == 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]


@pytest.mark.parametrize("compiled", [False, True])
def test_steps_equal_torch_adamw_with_a_changing_lr_and_a_folded_scale(compiled):
    reference, ours = _twins()
    expected = torch.optim.AdamW(_groups(reference), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    optimizer = CompiledAdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    if not compiled:  # the formula itself, uncompiled
        optimizer._update = adamw_update
    for step in range(4):
        for model in (reference, ours):
            model.zero_grad()
            model(torch.randn(7, 6, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        scale = torch.tensor(0.5 + step)  # the gradients are divided by it as the step reads them
        for p in reference.parameters():
            p.grad /= scale
        optimizer.grad_scale = scale
        for group_a, group_b in zip(expected.param_groups, optimizer.param_groups):
            group_a["lr"] = group_b["lr"] = 1e-2 / (step + 1)  # the scheduler's rewrite
        expected.step()
        optimizer.step()
    for a, b in zip(reference.parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            # fp32 rounding: the bias corrections are fp32 tensors here, Python doubles in torch's loop
            torch.testing.assert_close(optimizer.state[b][key], expected.state[a][key], rtol=1e-5, atol=1e-6)
        assert float(optimizer.state[b]["step"]) == float(expected.state[a]["step"]) == 4
    assert optimizer.state_dict()["state"].keys() == expected.state_dict()["state"].keys()
    assert set(optimizer.state_dict()["state"][0]) == set(expected.state_dict()["state"][0])


def test_state_saved_by_torch_adamw_loads_and_continues_as_torch_would():
    """A checkpoint's optimizer state written by torch's AdamW (step on the host) loads into
    CompiledAdamW, and the next step equals torch's own continuation."""
    reference, ours = _twins(1)
    first = torch.optim.AdamW(_groups(reference), lr=1e-2, foreach=False)
    reference(torch.randn(4, 6)).square().sum().backward()
    first.step()
    ours.load_state_dict(reference.state_dict())
    optimizer = CompiledAdamW(_groups(ours), lr=1e-2)
    optimizer._update = adamw_update
    optimizer.load_state_dict(copy.deepcopy(first.state_dict()))  # as from a file: no shared tensors
    batch = torch.randn(4, 6)
    for model, step in ((reference, first), (ours, optimizer)):
        model.zero_grad()
        model(batch).square().sum().backward()
        step.step()
    for a, b in zip(reference.parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        assert float(optimizer.state[b]["step"]) == 2


def test_the_flag_builds_it_and_folds_the_clip_scale(runtime):
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, OptimizerConfig(compiled_step=True))
    assert isinstance(optimizer, CompiledAdamW) and folds_gradient_scale(optimizer)
    trainer = make_trainer(runtime, "--compile-optimizer-step", "--use-distributed-optimizer", "--train-iters", "2")
    assert [type(part) for part in local_optimizers(trainer.optimizer)] == [CompiledAdamW]  # ZeRO-1's own
    assert folds_gradient_scale(trainer.optimizer)  # the clip's scale reaches ZeRO-1's local step
    trainer.train()
    assert len(trainer.history) == 2 and all(torch.isfinite(torch.tensor(r.loss)) for r in trainer.history)
