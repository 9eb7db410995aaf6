"""Batch-size ramp-up, the sample-based LR schedule, the decoupled LR and the weight-decay schedule.

Expected values are written out here from Megatron-LM's rules, not read from the implementation.
"""

import math
import re

import pytest
import torch
import torch.distributed as dist

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron.core.optimizer.optimizer import OptimizerConfig, build_optimizer, local_optimizers
from megatron.training.arguments import parse_args, schedule_kwargs
from megatron.training.batch_schedule import BatchSchedule, parse_step_schedule
from tests.unit_tests.test_bad_inputs_training import error_line
from tests.unit_tests.test_training import TINY, make_trainer

# A ramp from 2 to 8 in steps of 2 over 12 samples: 3 increments, one per 12 / 3 = 4 samples; the
# k-th applies once 4k samples are consumed, the full 8 once more than 12 are. Steps start at
# 0, 2, 4, 8, 14 (> 12), 22 consumed samples: sizes 2, 2, 4, 6, 8, 8. --train-samples 30:
# Megatron counts the ramp steps while consumed <= 12 (4 steps, to 14), then (30 - 14) // 8 = 2.
RAMP = ["--global-batch-size", "8", "--micro-batch-size", "2", "--rampup-batch-size", "2", "2", "12",
        "--train-samples", "30"]
RAMP_STARTS = [0, 2, 4, 8, 14, 22]
RAMP_SIZES = [2, 2, 4, 6, 8, 8]
MAX_LR, MIN_LR, WARMUP_SAMPLES = 1e-3, 1e-4, 6




def test_rampup_sizes_follow_megatrons_rule():
    schedule = BatchSchedule(final=8, rampup=(2, 2, 12))
    assert [schedule.at(consumed) for consumed in RAMP_STARTS] == RAMP_SIZES
    assert [schedule.at(consumed) for consumed in (3, 7, 11, 12, 13)] == [2, 4, 6, 8, 8]
    assert schedule.iterations_for(30) == 6 and schedule.samples_after(6) == 30
    assert schedule.sizes() == [2, 4, 6, 8]


def test_step_schedule_reads_tokens_and_suffixes():
    # seq 32: 64 tokens = 2 samples, 0.2K = 200 tokens = 6 samples (integer division).
    assert parse_step_schedule("0:2, 0.2K:8 64:4", seq_length=32) == [(0, 2), (2, 4), (6, 8)]
    assert parse_step_schedule("0:16 2.4B:320", seq_length=2048) == [(0, 16), (1171875, 320)]
    schedule = BatchSchedule.from_flags(999, step_batch_size_schedule="0:2 64:4 0.2K:8", seq_length=32)
    assert schedule.final == 8
    # Steps start at 0, 2, 6, 14, 22 samples; Megatron steps while fewer than 30 are consumed: 5 steps.
    assert [schedule.at(c) for c in (0, 2, 6, 14, 22)] == [2, 4, 8, 8, 8]
    assert schedule.iterations_for(30) == 5 and schedule.samples_after(5) == 30


@pytest.mark.parametrize("extra,message", [
    (["--train-samples", "30", "--rampup-batch-size", "3", "1", "12", "--global-batch-size", "8",
      "--micro-batch-size", "2"], "--rampup-batch-size reaches global batch size 3, which is not divisible"),
    (["--train-samples", "30", "--rampup-batch-size", "2", "4", "12", "--global-batch-size", "8"],
     "cannot reach --global-batch-size 8"),
    (["--train-samples", "30", "--step-batch-size-schedule", "0:2 64:4", "--global-batch-size", "8"],
     "differs from the last size 4 of --step-batch-size-schedule"),
    (["--train-samples", "30", "--step-batch-size-schedule", "64:4"], "must start at threshold 0"),
    (["--train-samples", "30", "--step-batch-size-schedule", "0:8 64:4"], "shrinks the batch from 8 to 4"),
    (["--train-samples", "30", "--lr-warmup-iters", "2"], "--lr-warmup-iters does not apply"),
    (["--train-iters", "3", "--lr-decay-samples", "20"], "--lr-decay-samples does not apply"),
    (["--train-iters", "3", "--decoupled-min-lr", "1e-5"], "--decoupled-min-lr has no effect without --decoupled-lr"),
    (["--train-iters", "3", "--decoupled-lr", "1e-5", "--min-lr", "1e-4"], "--min-lr 0.0001 exceeds --decoupled-lr"),
    (["--train-iters", "3", "--start-weight-decay", "0.1"], "--start-weight-decay has no effect without"),
    (["--train-iters", "3", "--weight-decay-incr-style", "linear"], "needs --start-weight-decay and --end-weight"),
])
def test_bad_schedule_flags_exit_2_with_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY + extra, add_difflm_args, world_size=1)
    assert exit_info.value.code == 2
    assert message in error_line(capsys.readouterr().err)


def recording(contexts):
    def forward_step(data_iterator, model, ctx, config):
        contexts.append((ctx.iteration, ctx.first_sample_index, ctx.global_batch_size, ctx.microbatch))
        return pretrain_difflm.forward_step(data_iterator, model, ctx, config)
    return forward_step


def expected_lr(samples):
    """Megatron's linear schedule at `samples` consumed: warmup over 6, decay to --train-samples 30."""
    if samples <= WARMUP_SAMPLES:
        return MAX_LR * samples / WARMUP_SAMPLES
    return MIN_LR + (1 - (samples - WARMUP_SAMPLES) / (30 - WARMUP_SAMPLES)) * (MAX_LR - MIN_LR)


def record_lrs(trainer):
    """After every applied update: the lr of each parameter, by name."""
    recorded, advance = [], trainer.scheduler.advance

    def advance_and_record(global_batch_size):
        advance(global_batch_size)
        recorded.append(lr_by_parameter(trainer.model, trainer.optimizer))
    trainer.scheduler.advance = advance_and_record
    return recorded


def lr_by_parameter(model, optimizer):
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    return {name: group_of[id(p)]["lr"] for name, p in model.named_parameters()}


def test_ramp_steps_keys_and_sample_based_lr(runtime, capsys):
    contexts = []
    trainer = make_trainer(runtime, *RAMP, "--lr-warmup-samples", str(WARMUP_SAMPLES), "--min-lr", str(MIN_LR),
                           "--model-running-mode", "difflm-noshift", "--difflm-t-sampling", "antithetic",
                           "--log-interval", "1", forward_step=recording(contexts))
    assert trainer.config.train_iters == 6
    lrs = record_lrs(trainer)
    state = trainer.train()
    assert [r.global_batch_size for r in trainer.history] == RAMP_SIZES
    assert [int(v) for v in re.findall(r"global batch size: +(\d+)", capsys.readouterr().out)] == RAMP_SIZES
    assert state.consumed_train_samples == 30 and state.consumed_train_tokens == 30 * 32
    # Every micro-batch of step k carries the step's first sample and batch size (the DLM keys).
    micro = [size // 2 for size in RAMP_SIZES]
    assert contexts == [(k, RAMP_STARTS[k], RAMP_SIZES[k], m) for k in range(6) for m in range(micro[k])]
    # The LR counts samples: after step k it is the schedule at the samples consumed so far.
    consumed = [start + size for start, size in zip(RAMP_STARTS, RAMP_SIZES)]
    for after_step, n in zip(lrs, consumed):
        assert list(after_step.values()) == pytest.approx([expected_lr(n)] * len(after_step), rel=1e-12), n
    assert trainer.scheduler.num_steps == 30 and trainer.scheduler.num_updates == 6


def test_a_ramp_with_train_iters_runs_that_many_steps_and_counts_the_lr_in_steps(runtime):
    """Megatron-LM's GPT-3 175B script ramps with --train-iters (which Megatron itself refuses)."""
    iters = [a if a != "--train-samples" else "--train-iters" for a in RAMP[:-1]] + ["5"]
    trainer = make_trainer(runtime, *iters)
    state = trainer.train()
    assert [r.global_batch_size for r in trainer.history] == RAMP_SIZES[:5]
    assert state.iteration == 5 and state.consumed_train_samples == sum(RAMP_SIZES[:5])
    assert trainer.scheduler.num_steps == 5 and trainer.scheduler.num_updates == 5


def test_resume_mid_ramp_matches_uninterrupted_run(tmp_path):
    flags = TINY + RAMP + ["--model-running-mode", "difflm-noshift", "--hidden-dropout", "0.1"]
    whole = pretrain_difflm.main(flags)
    first = pretrain_difflm.main(flags + ["--save", str(tmp_path), "--exit-interval", "3"])
    assert first.state.consumed_train_samples == 8  # inside the ramp: the next step has 6 samples
    rest = pretrain_difflm.main(flags + ["--load", str(tmp_path), "--save", str(tmp_path)])
    assert [r.global_batch_size for r in rest.history] == RAMP_SIZES[3:]
    assert [r.loss for r in first.history + rest.history] == [r.loss for r in whole.history]
    assert rest.scheduler.get_lr() == whole.scheduler.get_lr() and rest.scheduler.num_updates == 6


def cosine(n, peak, floor, warmup=1, decay=4):
    if n <= warmup:
        return peak * n / warmup
    return floor + 0.5 * (math.cos(math.pi * (n - warmup) / (decay - warmup)) + 1) * (peak - floor)


@pytest.mark.parametrize("untied", [True, False])
def test_decoupled_lr_reaches_embedding_and_output_only(runtime, untied):
    decoupled, decoupled_min = 5e-3, 1e-5
    trainer = make_trainer(runtime, "--train-iters", "4", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
                           "--min-lr", str(MIN_LR), "--decoupled-lr", str(decoupled), "--decoupled-min-lr",
                           str(decoupled_min), *(["--untie-embeddings-and-output-weights"] if untied else []))
    special = {"embedding.word_embeddings.weight"} | ({"output_layer.weight"} if untied else set())
    recorded = record_lrs(trainer)
    trainer.train()
    assert len(recorded) == 4 and special <= set(recorded[0])
    for step, lrs in enumerate(recorded, start=1):
        for name, lr in lrs.items():
            expected = cosine(step, decoupled, decoupled_min) if name in special else cosine(step, MAX_LR, MIN_LR)
            assert lr == pytest.approx(expected, rel=1e-12), (name, step)


def test_decoupled_lr_under_zero1_and_the_moe_chained_optimizer(runtime):
    trainer = make_trainer(runtime, "--train-iters", "2", "--num-experts", "2", "--moe-router-topk", "1",
                           "--untie-embeddings-and-output-weights")
    model = trainer.model
    optimizer = build_optimizer(model, OptimizerConfig(lr=MAX_LR, decoupled_lr=5e-3), dist.group.WORLD,
                                dist.group.WORLD)
    assert type(optimizer).__name__ == "ChainedOptimizer"
    args = parse_args(TINY + ["--train-iters", "2", "--decoupled-lr", "5e-3", "--lr-decay-style", "constant"],
                      add_difflm_args, world_size=1)
    OptimizerParamScheduler(optimizer, **schedule_kwargs(args))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # ZeRO copies its groups' lr into the local AdamW here
    names = {id(p): name for name, p in model.named_parameters()}
    seen = {}
    for part in local_optimizers(optimizer):
        for group in part.param_groups:
            for p in group["params"]:
                seen[names[id(p)]] = group["lr"]
    assert any("experts" in name for name in seen)
    for name, lr in seen.items():
        special = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        assert lr == (5e-3 if special else MAX_LR), name


def test_weight_decay_increments_like_megatron():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "wd_mult": 0.0}]
    for style, coeff in (("linear", lambda r: r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * (1 - r)) + 1))):
        optimizer = torch.optim.SGD([dict(g) for g in groups], lr=1.0)
        scheduler = OptimizerParamScheduler(optimizer, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                            lr_decay_style="constant", start_wd=0.01, end_wd=0.1, wd_incr_steps=10,
                                            wd_incr_style=style)
        for n in (0, 3, 10, 12):
            scheduler.step(n - scheduler.num_steps)
            ratio = min(n / 10, 1.0)
            assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.01 + coeff(ratio) * 0.09, rel=1e-12)
            assert optimizer.param_groups[1]["weight_decay"] == 0.0
    args = parse_args(TINY + ["--train-iters", "7", "--weight-decay-incr-style", "cosine", "--start-weight-decay",
                              "0.0", "--end-weight-decay", "0.2"], add_difflm_args, world_size=1)
    kwargs = schedule_kwargs(args)
    assert (kwargs["start_wd"], kwargs["end_wd"], kwargs["wd_incr_steps"]) == (0.0, 0.2, 7)


def test_scheduler_state_of_older_checkpoints_loads_as_iterations():
    scheduler = OptimizerParamScheduler(None, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=100,
                                        lr_decay_style="linear", unit="samples", weight_decay=0.1)
    old = {name: value for name, value in scheduler.state_dict().items()
           if name not in ("unit", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style", "num_updates")}
    old.update(num_steps=40, weight_decay=0.05)
    scheduler.load_state_dict(old)
    assert (scheduler.unit, scheduler.num_updates, scheduler.get_wd()) == ("iterations", 40, 0.05)
    scheduler.advance(8)
    assert scheduler.num_steps == 41
