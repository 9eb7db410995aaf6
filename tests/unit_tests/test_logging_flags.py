"""Logging, profiling and loop-utility flags (Megatron-LM's names): progress file, timers and
validation perplexity in tensorboard, the wandb run flags, --profile's trace, --manual-gc,
--empty-unused-memory-level and --skip-train. One process, the tiny model, a few steps each."""

import gc
import gzip
import json
import math
import sys
import types

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.training.arguments import parse_args
from megatron.training.configs import TrainingConfig
from megatron.training.loop_hooks import LoopHooks
from megatron.training.progress_log import ProgressLog
from megatron.training.timers import Timers
from megatron.training.training_log import cuda_memory_scalars, wandb_init_kwargs
from tests.distributed.parity import TINY_GQA
from tests.unit_tests.test_training import make_trainer as tiny_trainer


def make_trainer(runtime, *extra):
    return tiny_trainer(runtime, *extra, base=TINY_GQA)


def scalars(log_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def saved_run(runtime, tmp_path_factory):
    """4 steps through pretrain() with --log-progress, a save every 2 and timers in tensorboard."""
    root = tmp_path_factory.mktemp("progress")
    argv = TINY_GQA + ["--train-iters", "4", "--save", str(root / "ckpt"), "--save-interval", "2", "--log-progress",
                       "--tensorboard-dir", str(root / "tb"), "--log-timers-to-tensorboard"]
    trainer = pretrain_difflm.main(argv)
    return root, trainer


def test_progress_file_has_a_start_line_and_one_line_per_save(saved_run):
    root, trainer = saved_run
    lines = (root / "ckpt" / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3] for line in lines] == ["Starting job", "Saved checkpoint", "Saved checkpoint"]
    assert all(line.split("\t")[2] == "# GPUs: 1" for line in lines)
    fields = [dict(f.split(": ", 1) for f in line.split("\t")[4:]) for line in lines[1:]]
    per_sample = trainer.logger.flops_per_iteration / trainer.config.global_batch_size
    for iteration, saved in zip((2, 4), fields):
        assert saved["Iteration"] == str(iteration) and saved["Consumed samples"] == str(iteration)
        assert float(saved["Floating-point operations"]) == pytest.approx(per_sample * iteration, rel=1e-2)
        assert saved["Job throughput"].endswith(" TFLOP/s/GPU") and float(saved["Job throughput"].split()[0]) >= 0
    assert not list((root / "ckpt").glob("*.tmp")), "written under a temporary name, then renamed"
    recorded = scalars(root / "tb")
    assert sorted(recorded["save-checkpoint-time"]) == [2, 4]


def test_cumulative_progress_starts_at_the_first_job_of_this_world_size(tmp_path):
    def line(day, gpus, event, flops=None):
        saved = (f"\tIteration: 10\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\t"
                 f"Floating-point operations: {flops:.2e}\tTokens (in billions): 0.00") if flops else ""
        return f"2020-01-0{day} 00:00:00\tJob ID: \t# GPUs: {gpus}\t{event}{saved}\n"

    path = tmp_path / "progress.txt"
    path.write_text(line(1, 4, "Starting job") + line(2, 4, "Saved checkpoint", 1e15) + line(3, 8, "Starting job")
                    + line(4, 8, "Saved checkpoint", 5e15) + line(5, 4, "Starting job") + line(6, 4, "Starting job")
                    + "torn line without fields")
    log = ProgressLog(str(tmp_path), world_size=4, flops_per_sample=1e12)
    started, flops = log._first_start()
    assert (str(started), flops) == ("2020-01-05 00:00:00", 5e15), "the 4-GPU run since the 8-GPU job's save"
    log.start(consumed_samples=5000)
    assert path.read_text().splitlines()[-2] == "torn line without fields", "old lines are kept, each whole"


def test_timers_and_validation_ppl_reach_tensorboard(runtime, tmp_path, capsys):
    trainer = make_trainer(runtime, "--train-iters", "4", "--tensorboard-dir", str(tmp_path), "--log-interval", "2",
                           "--log-timers-to-tensorboard", "--timing-log-level", "2", "--eval-iters", "1",
                           "--eval-interval", "4", "--log-validation-ppl-to-tensorboard", "--tensorboard-log-interval",
                           "2", "--log-batch-size-to-tensorboard", "--log-world-size-to-tensorboard",
                           "--no-log-learning-rate-to-tensorboard", "--tensorboard-queue-size", "5")
    assert trainer.logger.writer.max_queue == 5
    trainer.train()
    trainer.logger.close()
    recorded = scalars(tmp_path)
    for name in ("forward-backward", "all-grads-sync", "optimizer", "batch-generator"):
        assert sorted(recorded[f"{name}-time"]) == [2, 4] and recorded[f"{name}-time"][4] > 0, name
    assert recorded["forward-backward-time"][4] >= recorded["batch-generator-time"][4], "the fetches are inside"
    assert sorted(recorded["evaluate-time"]) == [4]
    assert recorded["lm loss validation ppl"][4] == pytest.approx(math.exp(recorded["lm loss validation"][4]))
    assert sorted(recorded["lm loss"]) == [2, 4], "every --tensorboard-log-interval steps"
    assert recorded["lm loss"][4] == pytest.approx(trainer.history[3].loss, rel=1e-6), "the step's loss"
    assert recorded["batch-size"][2] == 1 and recorded["world-size"][2] == 1 and "loss-scale" in recorded
    assert "learning-rate" not in recorded
    assert "lm loss vs samples" in recorded
    console = capsys.readouterr().out
    assert "(min, max) time across ranks (ms):" in console and "forward-backward ......" in console


def test_without_the_flags_tensorboard_has_no_timers_nor_ppl(runtime, tmp_path):
    trainer = make_trainer(runtime, "--train-iters", "2", "--tensorboard-dir", str(tmp_path), "--eval-iters", "1",
                           "--eval-interval", "2")
    trainer.train()
    trainer.logger.close()
    recorded = scalars(tmp_path)
    assert "lm loss validation" in recorded and "learning-rate" in recorded
    assert not [tag for tag in recorded if tag.endswith("-time") or tag.endswith("ppl")], sorted(recorded)


def test_timer_report_options():
    gathered = {"forward-backward": [0.2, 0.4], "optimizer": [0.0, 0.1]}
    assert Timers(1, "max").report(gathered, 2).splitlines() == [
        "max time across ranks (ms):", f"    {'forward-backward '.ljust(48, '.')}: 200.00",
        f"    {'optimizer '.ljust(48, '.')}: 50.00"]
    assert f"{'forward-backward '.ljust(48, '.')}: (100.00, 200.00)" in Timers(1, "minmax").report(gathered, 2)
    assert Timers(1, "all").report(gathered, 2).splitlines()[-1] == "     rank  1: 50.00", "ranks that ran only"


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = types.SimpleNamespace(init=[], log=[], finished=False)
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: (calls.init.append(kwargs), module)[1]
    module.log = lambda values, step=None: calls.log.append((step, values))
    module.finish = lambda: setattr(calls, "finished", True)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_init_receives_the_run_flags(runtime, tmp_path, fake_wandb):
    trainer = make_trainer(runtime, "--train-iters", "1", "--log-interval", "1", "--save", str(tmp_path),
                           "--wandb-project", "dlm", "--wandb-exp-name", "run-a", "--wandb-run-id", "id-7",
                           "--wandb-mode", "offline", "--wandb-tags", "dlm, 1.7b", "--wandb-notes", "training",
                           "--wandb-resume", "allow", "--wandb-group", "sweep", "--wandb-entity", "lab")
    trainer.train()
    trainer.logger.close()
    (init,) = fake_wandb.init
    expected = dict(project="dlm", name="run-a", id="id-7", mode="offline", tags=["dlm", "1.7b"], notes="training",
                    resume="allow", group="sweep", entity="lab", dir=str(tmp_path / "wandb"))
    assert {key: init[key] for key in expected} == expected and "resume_from" not in init
    assert (tmp_path / "wandb").is_dir() and init["config"]["training"]["train_iters"] == 1
    assert any(step == 1 and "lm loss" in values for step, values in fake_wandb.log) and fake_wandb.finished


def test_wandb_save_dir_and_resume_from():
    args = parse_args(TINY_GQA + ["--wandb-project", "p", "--wandb-save-dir", "/tmp/wandb-here",
                                  "--wandb-resume-from", "id-7?_step=200"], add_difflm_args, world_size=1)
    kwargs = wandb_init_kwargs(args.logging_config, {})
    assert kwargs["dir"] == "/tmp/wandb-here" and kwargs["resume_from"] == "id-7?_step=200"
    assert "resume" not in kwargs and "entity" not in kwargs and kwargs["tags"] is None


def test_profile_traces_exactly_the_chosen_steps(runtime, tmp_path):
    trainer = make_trainer(runtime, "--train-iters", "4", "--profile", "--use-pytorch-profiler",
                           "--profile-step-start", "1", "--profile-step-end", "3", "--tensorboard-dir",
                           str(tmp_path / "tb"), "--pytorch-profiler-collect-shapes")
    trainer.train()
    trainer.logger.close()
    path = tmp_path / "torch_profile" / "rank-0.json.gz"
    with gzip.open(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    steps = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]
    operators = [e for e in events if str(e.get("name", "")).startswith("aten::")]
    assert operators, "the steps' operators are recorded"
    assert any("Input Dims" in e.get("args", {}) for e in operators), "--pytorch-profiler-collect-shapes"
    assert not list((tmp_path / "torch_profile").glob(".*")), "no temporary file left"


def test_manual_gc_disables_gc_and_collects_at_the_interval(runtime, monkeypatch):
    trainer = make_trainer(runtime, "--train-iters", "4", "--manual-gc", "--manual-gc-interval", "2",
                           "--eval-iters", "1", "--eval-interval", "4")
    calls, collect = [], gc.collect

    def counting_collect(generation=2):
        calls.append((trainer.state.iteration, generation, gc.isenabled()))
        return collect(generation)

    monkeypatch.setattr(gc, "collect", counting_collect)
    assert gc.isenabled()
    trainer.train()
    # At the start; after step 2; around the evaluation after step 4 (all, then what it left); after step 4.
    assert calls == [(0, 2, False), (2, 2, False), (4, 2, False), (4, 0, False), (4, 2, False)]
    assert gc.isenabled(), "automatic collection is back once training ends"


def test_empty_unused_memory_levels(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for level, expected in ((0, 0), (1, 2), (2, 3)):
        emptied.clear()
        hooks = LoopHooks(TrainingConfig(empty_unused_memory_level=level), device=torch.device("cuda"))
        hooks.phase_end("forward-backward")
        hooks.phase_end("optimizer")
        with hooks.evaluation(iteration=1):
            pass
        assert len(emptied) == expected, level
    cpu = LoopHooks(TrainingConfig(empty_unused_memory_level=2), device=torch.device("cpu"))
    cpu.phase_end("forward-backward")
    assert not emptied[3:], "a no-op on CPU"


def test_memory_scalars_use_megatrons_names(monkeypatch):
    stats = {"reserved_bytes.all.current": 4, "allocated_bytes.all.current": 3, "allocated_bytes.all.peak": 5,
             "allocation.all.current": 2}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    assert cuda_memory_scalars(torch.device("cuda")) == {"mem-reserved-bytes": 4, "mem-allocated-bytes": 3,
                                                         "mem-max-allocated-bytes": 5, "mem-allocated-count": 2}


def test_skip_train_evaluates_the_loaded_checkpoint_only(saved_run, capsys):
    root, _ = saved_run
    argv = TINY_GQA + ["--train-iters", "8", "--load", str(root / "ckpt"), "--save", str(root / "ckpt"),
                       "--save-interval", "2", "--skip-train", "--eval-iters", "1"]
    trainer = pretrain_difflm.main(argv)
    assert trainer.history == [] and trainer.state.iteration == 4, "no optimizer step"
    assert (root / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4", "nothing saved"
    console = capsys.readouterr().out
    assert "loaded" in console and "validation loss at iteration 4 | lm loss value:" in console


@pytest.mark.parametrize("argv,message", [
    (["--manual-gc-interval", "2"], "--manual-gc-interval has no effect without --manual-gc"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], "--profile-step-end 5 must be greater"),
    (["--profile-step-start", "2"], "--profile-step-start has no effect without --profile"),
    (["--log-progress"], "--log-progress has no effect without --save"),
    (["--wandb-tags", "dlm"], "--wandb-tags has no effect without --wandb-project"),
    (["--log-timers-to-tensorboard"], "--log-timers-to-tensorboard has no effect without --tensorboard-dir"),
    (["--skip-train", "--eval-iters", "0"], "--skip-train only evaluates"),
    (["--timing-log-option", "max"], "--timing-log-option has no effect without --timing-log-level"),
])
def test_bad_logging_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY_GQA + argv, add_difflm_args, world_size=1)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.gpu
def test_cuda_memory_statistics_history_and_kernel_trace(runtime, tmp_path):
    trainer = make_trainer(runtime, "--train-iters", "2", "--log-interval", "2", "--tensorboard-dir",
                           str(tmp_path / "tb"), "--log-memory-to-tensorboard", "--record-memory-history",
                           "--memory-snapshot-path", str(tmp_path / "snap.pickle"), "--empty-unused-memory-level", "2",
                           "--profile",
                           "--profile-step-start", "0", "--profile-step-end", "1")
    trainer.train()
    trainer.logger.close()
    recorded = scalars(tmp_path / "tb")
    assert recorded["mem-allocated-bytes"][2] > 0 and recorded["mem-max-allocated-bytes"][2] > 0
    assert (tmp_path / "snap_0.pickle").stat().st_size > 0, "the allocator history of rank 0"
    with gzip.open(tmp_path / "torch_profile" / "rank-0.json.gz", "rt") as handle:
        events = json.load(handle)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), "the GPU's kernels are traced too"


def test_the_console_mfu_names_both_peaks_under_fp8(runtime):
    trainer = tiny_trainer(runtime, "--train-iters", "1", "--log-throughput")
    logger, state = trainer.logger, trainer.state
    rates = {"tflops_per_gpu": 500.0, "tokens_per_sec_per_gpu": 1.0, "mfu": 500.0 / 989.0}
    line = logger._line(state, 0.2, 1e-4, 2.0, 1.0, 1.0, rates, 4)
    assert "MFU: 50.6% |" in line and "fp8 peak" not in line
    logger.fp8_peak = 1979.0
    line = logger._line(state, 0.2, 1e-4, 2.0, 1.0, 1.0, rates, 4)
    assert "MFU: 50.6% of the bf16 peak, 25.3% of the fp8 peak" in line
    rates["tflops_per_gpu"] = 0.0021
    assert "(TFLOP/s/GPU): 0.0021 |" in logger._line(state, 0.2, 1e-4, 2.0, 1.0, 1.0, rates, 4)
