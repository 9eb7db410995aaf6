"""The measured pipeline bubble: the ComputeClock times only the spans a schedule gives it, the level-2
timers read it at forward-backward's lap, and the report derives each stage's bubble from them.
(tests/distributed/test_pretrain_cli.py runs it on a real 2-stage pipeline.)"""

import time

import pytest
import torch

from megatron.core.pipeline_parallel.compute_clock import ComputeClock, bubble_formula
from megatron.training.timers import Timers, pipeline_bubbles


def test_the_clock_times_only_its_spans():
    clock = ComputeClock(torch.device("cpu"))
    for _ in range(3):
        with clock.span("forward-compute"):
            time.sleep(0.02)
        time.sleep(0.03)  # waiting for a neighbour: not compute
    with clock.span("backward-compute"):
        time.sleep(0.01)
    totals = clock.collect()
    # the spans' 60 ms, and well short of the 90 ms of waiting between them (slack for a loaded machine)
    assert 0.06 <= totals["forward-compute"] < 0.15, totals
    assert 0.01 <= totals["backward-compute"] < 0.06, totals
    assert clock.collect() == {"forward-compute": 0.0, "backward-compute": 0.0}, "collect clears the spans"


def test_the_timers_hand_out_a_clock_at_level_two_and_read_it_at_forward_backward():
    assert Timers(1).compute_clock() is None
    timers = Timers(2)
    clock = timers.compute_clock()
    assert clock is timers.compute_clock(), "one clock for the whole run"
    timers.step_start()
    with clock.span("forward-compute"):
        time.sleep(0.02)
    time.sleep(0.02)
    timers.lap("forward-backward")
    totals = timers.totals
    assert 0.02 <= totals["forward-compute"] < totals["forward-backward"]
    assert totals["backward-compute"] == 0.0


def test_the_report_derives_each_stage_s_bubble():
    gathered = {"forward-backward": [1.0, 1.0, 2.0], "forward-compute": [0.3, 0.4, 0.5],
                "backward-compute": [0.5, 0.4, 1.0]}
    assert pipeline_bubbles(gathered) == pytest.approx([0.2, 0.2, 0.25])
    for option in ("minmax", "all"):
        report = Timers(2, option).report(gathered, steps=1)
        assert report.splitlines()[-1] == ("pipeline bubble (1 - compute / forward-backward): min 20.0%, "
                                           "mean 21.7%, max 25.0% over 3 ranks")
    assert "bubble" not in Timers(2).report({"forward-backward": [1.0]}, steps=1), "no pipeline, no bubble line"


def test_the_one_f_one_b_formula():
    assert bubble_formula(2, 2) == pytest.approx(1 / 3)
    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
    assert bubble_formula(4, 8, virtual_stages=2) == pytest.approx(3 / 19)
    assert bubble_formula(1, 8) == 0.0
