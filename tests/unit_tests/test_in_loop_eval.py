"""Evaluation inside the training loop: lm-eval tasks on the live model (--lm-eval-tasks) and the
validation ELBO over K corruption draws per row (--difflm-eval-mc-samples)."""

import functools
import sys
from pathlib import Path

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.training.arguments import parse_args
from megatron.training.run_config import parse_run_config
from megatron.training.step_state import validation_stream
from megatron.training.training import build_trainer

ROOT = Path(__file__).resolve().parents[2]
SPM = str(ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model")
TASKS = ["megadlms_tiny_mc", "megadlms_tiny_gen"]
# A text tokenizer (lm-eval's tasks are text) over mock documents.
TEXT_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--mock-data", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
              SPM, "--make-vocab-size-divisible-by", "32", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
              "--attention-backend", "math", "--global-batch-size", "2",
              "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
# Dropout: the steps after an evaluation draw from the torch generator that lm-eval reseeds.
DROPOUT = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]
MODEL_ARGS = "mc_num=2,batch_size=8,gen_length=4,steps=2,seed=3"


def task_folder(root: Path) -> str:
    """The bundled offline tasks with absolute data paths (workers may run from another folder)."""
    folder = root / "tasks"
    folder.mkdir(exist_ok=True)
    for source in (ROOT / "tests" / "assets" / "lm_eval").glob("*.yaml"):
        text = source.read_text().replace("tests/assets/lm_eval/", f"{ROOT}/tests/assets/lm_eval/")
        (folder / source.name).write_text(text)
    return str(folder)


def lm_eval_flags(folder: str, interval: int = 2) -> list:
    return ["--lm-eval-tasks", *TASKS, "--lm-eval-interval", str(interval), "--lm-eval-include-path", folder,
            "--lm-eval-model-args", MODEL_ARGS]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return task_folder(tmp_path)


def train(runtime, argv):
    trainer = build_trainer(parse_run_config(argv, add_difflm_args, world_size=1), runtime,
                            pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                            pretrain_difflm.forward_step)
    trainer.train()
    trainer.logger.close()
    return trainer


def scalars(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]
            if tag.startswith("lm-eval/")}


def test_in_loop_lm_eval_logs_every_metric_and_trains_bit_identically(runtime, offline, tmp_path, capsys):
    pytest.importorskip("lm_eval")  # an optional (dev) dependency, like the adapter's own tests
    base = TEXT_MODEL + DROPOUT + ["--train-iters", "3"]
    plain = train(runtime, base)
    evaluated = train(runtime, base + lm_eval_flags(offline) + ["--tensorboard-dir", str(tmp_path / "tb"),
                                                                "--lm-eval-limit", "3", "--use-on-the-fly-eval"])
    # Every --lm-eval-interval (2) iterations and after the last (3); the dropout of the steps after
    # an evaluation draws from the same generator states as without it.
    assert [r.loss for r in evaluated.history] == [r.loss for r in plain.history]
    for (name, value), other in zip(evaluated.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(value, other), name
    assert evaluated.model.training
    history = evaluated.lm_eval.history
    assert sorted(history) == [2, 3] and set(history[2]) == set(TASKS)
    assert {"acc", "acc_norm"} <= set(history[2]["megadlms_tiny_mc"]) and "exact_match" in history[2][TASKS[1]]
    assert history[2]["megadlms_tiny_mc"]["samples"] == history[2][TASKS[1]]["samples"] == 3  # --lm-eval-limit
    out = capsys.readouterr().out
    for iteration, metrics in history.items():
        for task, values in metrics.items():
            line = f" lm-eval {task} | " + " | ".join(f"{name}: {value:.6g}" for name, value in values.items()) + " |"
            assert line in out
    recorded = scalars(tmp_path / "tb")
    assert recorded == {f"lm-eval/{task}/{name}": {iteration: pytest.approx(history[iteration][task][name])
                                                   for iteration in history}
                        for task in TASKS for name in history[2][task]}


def test_bad_model_args_and_unknown_tasks_exit_1_while_building(offline, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    # Without this, the unknown name makes lm-eval index its thousands of own tasks (~30 s on two cores).
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                        include_defaults=False))
    base = TEXT_MODEL + ["--train-iters", "1", "--lm-eval-include-path", offline]
    for extra, message in ((["--lm-eval-tasks", "nope_task"], "--lm-eval-tasks: nope_task is not one of"),
                           (["--lm-eval-tasks", TASKS[0], "--lm-eval-model-args", "mcnum=4"],
                            "--lm-eval-model-args: megadlms: unknown model_args ['mcnum']")):
        with pytest.raises(SystemExit) as exit_info:
            pretrain_difflm.main(base + extra)
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert "Traceback" not in err and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("extra, world, message", [
    (["--lm-eval-interval", "5"], 1, "--lm-eval-interval has no effect without --lm-eval-tasks"),
    (["--use-on-the-fly-eval"], 1, "--use-on-the-fly-eval has no effect without --lm-eval-tasks"),
    (["--lm-eval-tasks", "x", "--lm-eval-model-args", "load=/ckpt"], 1, "load= is the run's own"),
    (["--lm-eval-tasks", "x", "--lm-eval-model-args", "mc_num"], 1, "'mc_num' is not key=value"),
    (["--lm-eval-tasks", "x", "--pipeline-model-parallel-size", "2"], 2, "--pipeline-model-parallel-size 2 splits"),
    (["--lm-eval-tasks", "x", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "4"], 2,
     "MoE layers under tensor parallelism cannot"),
    (["--difflm-eval-mc-samples", "0"], 1, "--difflm-eval-mc-samples 0 must be >= 1"),
])
def test_bad_lm_eval_flags_are_one_line_at_start_up(extra, world, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TEXT_MODEL + ["--train-iters", "1"] + extra, add_difflm_args, world_size=world)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_without_lm_eval_installed_the_tasks_are_one_line_naming_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # find_spec then reports it missing
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TEXT_MODEL + ["--train-iters", "1", "--lm-eval-tasks", "x"], add_difflm_args, world_size=1)
    assert exit_info.value.code == 2 and "--lm-eval-tasks needs the lm-evaluation-harness: pip install lm-eval" in (
        capsys.readouterr().err)


def test_lm_eval_tasks_need_a_text_tokenizer(capsys):
    null_tokenizer = [flag for flag in TEXT_MODEL if flag not in ("--tokenizer-type", "SentencePieceTokenizer",
                                                                  "--tokenizer-model", SPM)]
    with pytest.raises(SystemExit):
        parse_args(null_tokenizer + ["--vocab-size", "64", "--add-mask-token", "--train-iters", "1",
                                     "--lm-eval-tasks", "x"], add_difflm_args, world_size=1)
    assert "--lm-eval-tasks needs a text tokenizer" in capsys.readouterr().err


def _draw_loss(trainer, stream: int):
    """One evaluation by hand: the validation batches under one corruption stream."""
    loss_sum = normalizer = 0.0
    data = trainer.valid_loader()
    trainer.model.eval()
    with torch.no_grad():
        for step in range(trainer.config.eval_iters):
            loss = trainer._forward_backward(data, False, 0, step * trainer.config.global_batch_size, stream=stream)
            loss_sum, normalizer = loss_sum + float(loss.loss_sum), normalizer + float(loss.normalizer)
    trainer.model.train()
    return loss_sum / normalizer


def test_validation_elbo_averages_k_independent_draws(runtime, capsys):
    from tests.unit_tests.test_training import make_trainer

    flags = ["--train-iters", "1", "--eval-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "4"]
    single = make_trainer(runtime, *flags)
    assert single.evaluate() == _draw_loss(single, 1)  # K = 1 is the single draw of stream 1, exactly
    pooled = make_trainer(runtime, *flags, "--difflm-eval-mc-samples", "4")
    draws = [_draw_loss(pooled, validation_stream(k)) for k in range(4)]
    assert len(set(draws)) == 4 and draws[0] == single.evaluate()  # independent draws, the first today's
    # The default tokens normalizer is the same for every draw: the pooled loss is the mean of the four.
    assert pooled.evaluate() == pytest.approx(sum(draws) / 4, rel=1e-12)
    assert len({validation_stream(k) for k in range(4)} | {0}) == 5
    vanilla = make_trainer(runtime, *flags, "--difflm-eval-mc-samples", "4", "--model-running-mode", "vanilla")
    assert vanilla.config.difflm_eval_mc_samples == 1
    assert "--difflm-eval-mc-samples 4: no effect with --model-running-mode vanilla" in capsys.readouterr().err


def test_a_block_diffusion_run_scores_and_generates(runtime, offline):
    """A BD3 run evaluates both kinds of task: the multiple-choice one by the block-wise ELBO."""
    pytest.importorskip("lm_eval")
    bd3 = TEXT_MODEL + ["--train-iters", "1", "--difflm-block-diffusion", "--difflm-block-size", "8",
                        "--add-mask-token", "--lm-eval-include-path", offline, "--lm-eval-model-args", MODEL_ARGS]
    trainer = train(runtime, bd3 + ["--lm-eval-tasks", *TASKS])
    assert set(TASKS) <= set(trainer.lm_eval.history[1])
    assert 0.0 <= trainer.lm_eval.history[1][TASKS[0]]["acc"] <= 1.0


def test_a_block_curriculum_run_evaluates_with_the_blocks_it_last_trained(runtime, offline, monkeypatch):
    """At iteration 2 of the schedule 0:4,1:8 the model last trained with blocks of 8: lm-eval samples and
    scores with them, not with the schedule's first size."""
    lm_eval = pytest.importorskip("lm_eval")
    seen, evaluate = [], lm_eval.simple_evaluate

    def recording(**kwargs):
        seen.append(kwargs["model"].backend.pattern["attention_block_size"])
        return evaluate(**kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", recording)
    run = TEXT_MODEL + ["--train-iters", "2", "--difflm-block-diffusion", "--difflm-block-size-schedule", "0:4,1:8",
                        "--add-mask-token", "--lm-eval-include-path", offline, "--lm-eval-model-args", MODEL_ARGS,
                        "--lm-eval-interval", "1", "--lm-eval-tasks", TASKS[0]]
    train(runtime, run)
    assert seen == [4, 8]  # after step 1 (trained with 4), after step 2 (with 8)
