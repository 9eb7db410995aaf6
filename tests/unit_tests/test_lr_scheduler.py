"""LR schedules: values against the formulas, param groups, resume, validation."""

import json
import math

import pytest
import torch

from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler

MAX_LR, MIN_LR, INIT_LR = 1e-3, 1e-4, 1e-5
WARMUP, DECAY, WSD_DECAY = 10, 100, 20
CHECK_STEPS = [0, 5, 10, 50, 80, 90, 100, 150]


def make_optimizer(lr_mults=(1.0,)):
    groups = []
    for mult in lr_mults:
        group = {"params": [torch.nn.Parameter(torch.zeros(2))]}
        if mult != 1.0:
            group["lr_mult"] = mult
        groups.append(group)
    return torch.optim.SGD(groups, lr=123.0)


def make_scheduler(style, optimizer=None, **overrides):
    kwargs = dict(max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
                  lr_decay_style=style, init_lr=INIT_LR, wsd_decay_steps=WSD_DECAY)
    kwargs.update(overrides)
    return OptimizerParamScheduler(optimizer or make_optimizer(), **kwargs)


def warmup_lr(n):
    return INIT_LR + (MAX_LR - INIT_LR) * n / WARMUP


def between(coeff):
    return MIN_LR + coeff * (MAX_LR - MIN_LR)


# Expected values written out per step from the definitions, independent of the implementation.
EXPECTED = {
    "constant": {0: INIT_LR, 5: warmup_lr(5), 10: MAX_LR, 50: MAX_LR, 80: MAX_LR, 90: MAX_LR,
                 100: MAX_LR, 150: MAX_LR},
    "linear": {0: INIT_LR, 5: warmup_lr(5), 10: MAX_LR, 50: between(1 - 40 / 90), 80: between(1 - 70 / 90),
               90: between(1 - 80 / 90), 100: MIN_LR, 150: MIN_LR},
    "cosine": {0: INIT_LR, 5: warmup_lr(5), 10: MAX_LR,
               50: between(0.5 * (math.cos(math.pi * 40 / 90) + 1)),
               80: between(0.5 * (math.cos(math.pi * 70 / 90) + 1)),
               90: between(0.5 * (math.cos(math.pi * 80 / 90) + 1)), 100: MIN_LR, 150: MIN_LR},
    "inverse-square-root": {0: INIT_LR, 5: warmup_lr(5), 10: MAX_LR,
                            50: MAX_LR * math.sqrt(10 / 50), 80: MAX_LR * math.sqrt(10 / 80),
                            90: MAX_LR * math.sqrt(10 / 90), 100: MAX_LR * math.sqrt(10 / 100),
                            150: max(MIN_LR, MAX_LR * math.sqrt(10 / 150))},
}
# WSD: stable until step 80 = 100 - 20, anneal ratio r = (n - 80) / 20: 0.5 at 90, 1 at 100.
WSD_EXPECTED = {
    "linear": {90: between(0.5)},
    "cosine": {90: between(0.5 * (math.cos(math.pi * 0.5) + 1))},
    "exponential": {90: between(2 * 0.5 ** 0.5 - 1)},
    "minus_sqrt": {90: between(1 - math.sqrt(0.5))},
}


@pytest.mark.parametrize("style", list(EXPECTED))
def test_values_match_formulas(style):
    scheduler = make_scheduler(style)
    for n in CHECK_STEPS:
        assert scheduler.get_lr(n) == pytest.approx(EXPECTED[style][n], rel=1e-12), (style, n)


@pytest.mark.parametrize("wsd_style", list(WSD_EXPECTED))
def test_wsd_values_match_formulas(wsd_style):
    scheduler = make_scheduler("WSD", lr_wsd_decay_style=wsd_style)
    expected = {0: INIT_LR, 5: warmup_lr(5), 10: MAX_LR, 50: MAX_LR, 80: MAX_LR,
                100: MIN_LR, 150: MIN_LR, **WSD_EXPECTED[wsd_style]}
    for n in CHECK_STEPS:
        assert scheduler.get_lr(n) == pytest.approx(expected[n], rel=1e-12, abs=1e-15), (wsd_style, n)


def test_inverse_square_root_is_floored_at_min_lr():
    scheduler = make_scheduler("inverse-square-root", min_lr=5e-4)
    assert scheduler.get_lr(1000) == 5e-4


def test_no_warmup_starts_at_max_lr():
    scheduler = make_scheduler("cosine", lr_warmup_steps=0)
    assert scheduler.get_lr(0) == pytest.approx(MAX_LR)
    assert scheduler.get_lr(50) == pytest.approx(between(0.5 * (math.cos(math.pi * 0.5) + 1)))


def test_step_writes_lr_with_multiplier_and_weight_decay_into_groups():
    optimizer = make_optimizer(lr_mults=(1.0, 0.1))
    optimizer.param_groups[1]["wd_mult"] = 0.0
    scheduler = make_scheduler("linear", optimizer=optimizer, weight_decay=0.05)
    # Construction writes step 0 over the optimizer's own lr.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(INIT_LR)
    scheduler.step(5)
    assert scheduler.num_steps == 5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(warmup_lr(5))
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.1 * warmup_lr(5))
    assert optimizer.param_groups[0]["weight_decay"] == 0.05
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    for _ in range(45):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(EXPECTED["linear"][50])


def test_state_dict_round_trip_continues_identically():
    original = make_scheduler("WSD", lr_wsd_decay_style="minus_sqrt")
    original.step(37)
    state = json.loads(json.dumps(original.state_dict()))  # plain numbers only
    assert state == original.state_dict()

    optimizer = make_optimizer()
    # Built from different flags: the checkpoint's schedule must win.
    resumed = OptimizerParamScheduler(optimizer, max_lr=5.0, min_lr=0.0, lr_warmup_steps=0,
                                      lr_decay_steps=10, lr_decay_style="linear")
    resumed.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(original.get_lr())
    for _ in range(60):
        original.step(1)
        resumed.step(1)
        assert resumed.get_lr() == original.get_lr()
    assert resumed.num_steps == original.num_steps == 97


def test_load_state_dict_rejects_incomplete_or_invalid_state():
    scheduler = make_scheduler("cosine")
    with pytest.raises(ValueError, match="num_steps"):
        scheduler.load_state_dict({"max_lr": 1.0})
    bad = scheduler.state_dict() | {"min_lr": 1.0, "num_steps": 3}
    with pytest.raises(ValueError, match="--min-lr"):
        scheduler.load_state_dict(bad)
    assert scheduler.min_lr == MIN_LR and scheduler.num_steps == 0


@pytest.mark.parametrize("overrides,flag", [
    ({"lr_decay_style": "poly"}, "--lr-decay-style"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_style": "step"}, "--lr-wsd-decay-style"),
    ({"min_lr": 2e-3}, "--min-lr greater than --lr"),
    ({"lr_warmup_steps": 100}, "--lr-warmup-iters exceeds --lr-decay-iters"),
    ({"lr_warmup_steps": -1}, "--lr-warmup-iters"),
    ({"lr_decay_steps": 0, "lr_warmup_steps": 0}, "--lr-decay-iters"),
    ({"lr_decay_style": "WSD", "wsd_decay_steps": None}, "--lr-wsd-decay-iters is required for WSD"),
    ({"lr_decay_style": "WSD", "wsd_decay_steps": 101}, "must be <= --lr-decay-iters"),
    ({"init_lr": -1.0}, "--lr-warmup-init"),
    ({"weight_decay": -0.1}, "--weight-decay"),
])
def test_validation_names_the_flag(overrides, flag):
    style = overrides.pop("lr_decay_style", "cosine")
    with pytest.raises(ValueError, match=flag.replace("-", r"\-")):
        make_scheduler(style, **overrides)
