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


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_moments_are_stored_in_bf16_and_follow_the_fp32_update(compiled):
    """Megatron's precision-aware optimizer: bf16 storage, an fp32 update, torch's AdamW within bf16 rounding."""
    reference, ours = _twins(2)
    expected = torch.optim.AdamW(_groups(reference), lr=1e-2, foreach=False)
    optimizer = CompiledAdamW(_groups(ours), lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    if not compiled:
        optimizer._update = adamw_update
    for step in range(4):
        for model, step_of in ((reference, expected), (ours, optimizer)):
            model.zero_grad()
            model(torch.randn(7, 6, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            step_of.step()
    for a, b in zip(reference.parameters(), ours.parameters()):
        state = optimizer.state[b]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and b.dtype == torch.float32
        first = expected.state[a]["exp_avg"]  # rounded to bf16 after each of the 4 updates
        assert (state["exp_avg"].float() - first).norm() <= 2 ** -7 * first.norm()
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)
        assert not torch.equal(b, a), "the moments' rounding reaches the weights"


def test_a_checkpoint_keeps_the_bf16_moments():
    """torch's loader casts moments to the parameter's dtype; ours casts them back, from a bf16 checkpoint
    or an fp32 one (a run switching to the precision-aware optimizer on resume)."""
    _, ours = _twins(3)
    ours(torch.randn(4, 6)).square().sum().backward()
    fp32 = CompiledAdamW(_groups(ours), lr=1e-2)
    fp32._update = adamw_update
    fp32.step()
    for source in (fp32, None):
        if source is None:  # a bf16 optimizer's own state round trip
            source = CompiledAdamW(_groups(ours), lr=1e-2, exp_avg_dtype=torch.bfloat16,
                                   exp_avg_sq_dtype=torch.bfloat16)
            source.load_state_dict(copy.deepcopy(fp32.state_dict()))
        loaded = CompiledAdamW(_groups(ours), lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
        loaded.load_state_dict(copy.deepcopy(source.state_dict()))
        for state in loaded.state.values():
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_the_precision_aware_flags_reach_the_optimizer_under_zero1(runtime):
    trainer = make_trainer(runtime, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                           "--use-distributed-optimizer", "--train-iters", "2")
    (local,) = local_optimizers(trainer.optimizer)
    assert isinstance(local, CompiledAdamW) and local.moment_dtypes == {"exp_avg": torch.bfloat16,
                                                                        "exp_avg_sq": torch.float32}
    trainer.train()
    state = next(iter(local.state.values()))
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (torch.bfloat16, torch.float32)
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in trainer.history)


@pytest.mark.parametrize("flags,message", [
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype has no effect without --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "bf16", "--data-parallel-sharding-strategy",
      "optim_grads_params"], "bf16 Adam moments (--exp-avg-dtype / --exp-avg-sq-dtype) are not supported with"),
])
def test_bad_precision_aware_flags_are_one_line(flags, message, capsys):
    from tests.unit_tests.test_bad_inputs_training import TINY, parse_error

    assert message in parse_error(TINY + flags, capsys)


def test_a_resumed_run_keeps_its_bf16_moments_and_trains_as_one_run(tmp_path, monkeypatch):
    """The checkpoint's moments are read into bf16 state (not fp32 zeros), so resuming changes nothing.
    --deterministic-mode: on CUDA the tied embedding's gradient rows are summed with atomics
    (tied_gradient.py), so two straight runs already differ in the last bits; resuming is exact
    against the run it continues, which only deterministic kernels make repeatable (tests/gpu/)."""
    import pretrain_difflm
    from tests.unit_tests.test_batch_schedule import TINY

    monkeypatch.setattr(torch, "compile", lambda function, **options: function)  # the formula, uncompiled
    flags = TINY + ["--train-iters", "6", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                    "--exp-avg-sq-dtype", "bf16", "--deterministic-mode"]
    whole = pretrain_difflm.main(flags)
    first = pretrain_difflm.main(flags + ["--save", str(tmp_path), "--exit-interval", "3"])
    rest = pretrain_difflm.main(flags + ["--load", str(tmp_path)])
    assert [r.loss for r in first.history + rest.history] == [r.loss for r in whole.history]
    (optimizer,) = local_optimizers(rest.optimizer)
    assert {state["exp_avg_sq"].dtype for state in optimizer.state.values()} == {torch.bfloat16}
