"""The launch scripts' flags pass validation at the layout each script is written for.

Each script runs with a stand-in `torchrun` on PATH that records its arguments
(tests/launch_flags.py); the flags after `pretrain_difflm.py` are then validated by
`parse_args` at the script's world size, so a flag the parser refuses, a layout the world size
cannot hold or a batch the layout cannot split fails here rather than on a cluster.
"""

import pytest

from custom_args.difflm import add_difflm_args
from custom_args.rl import add_rl_args, rl_settings
from megatron.training.arguments import parse_args
from tests.launch_flags import recorded_flags

# script: (GPUs it is written for, what the run must resolve to)
SCRIPTS = {
    "examples/dlm_training/dlm_pretrain_7b.sh": (8, {"tensor_model_parallel_size": 2,
                                                     "pipeline_model_parallel_size": 2, "data_parallel_size": 2,
                                                     "sequence_parallel": True,
                                                     "cache_low_precision_weights": True}),
    "examples/dlm_training/dlm_pretrain_1.7b.sh": (1, {"pipeline_model_parallel_size": 1,
                                                       "cache_low_precision_weights": True}),
    "examples/dlm_training/dlm_pretrain_125m.sh": (1, {"pipeline_model_parallel_size": 1}),
    "examples/ar_training/ar_pretrain_1.7b.sh": (1, {"model_running_mode": "vanilla",
                                                   "cache_low_precision_weights": True}),
    "examples/dlm_training/dlm_sft_1.7b.sh": (1, {"sft": True, "difflm_loss_normalizer": "sequence"}),
    "examples/dlm_training/dlm_pretrain_olmoe_1b_7b.sh": (1, {"num_experts": 64, "moe_router_topk": 8,
                                                              "expert_model_parallel_size": 1}),
    "examples/dlm_training/ar_to_dlm_1.7b.sh": (1, {"difflm_block_diffusion": True, "difflm_ar_loss_weight": 3.33,
                                                    "difflm_block_size_schedule": ((0, 1), (400, 4), (800, 32),
                                                                                   (1200, 64), (1600, 4096),
                                                                                   (18000, 32))}),
}


# script: its schedule without TRAIN_ITERS (run, warmup, WSD decay iterations; None: not WSD)
DEFAULT_SCHEDULES = {
    "examples/dlm_training/dlm_pretrain_7b.sh": (250000, 2000, 25000),
    "examples/dlm_training/dlm_pretrain_1.7b.sh": (500000, 2000, 50000),
    "examples/dlm_training/dlm_pretrain_125m.sh": (100000, 1000, 10000),
    "examples/ar_training/ar_pretrain_1.7b.sh": (500000, 2000, None),
    "examples/dlm_training/dlm_sft_1.7b.sh": (5000, 50, None),
    "examples/dlm_training/dlm_pretrain_olmoe_1b_7b.sh": (500000, 2000, 50000),
    "examples/dlm_training/ar_to_dlm_1.7b.sh": (20000, 500, 2000),
}
SCHEDULE_VARIABLES = ("TRAIN_ITERS", "LR_WARMUP_ITERS", "WSD_DECAY_ITERS")


def test_every_launch_script_has_its_default_schedule():
    assert set(DEFAULT_SCHEDULES) == set(SCRIPTS)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_without_train_iters_the_schedule_is_the_scripts(script, tmp_path, monkeypatch):
    for name in SCHEDULE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    gpus = SCRIPTS[script][0]
    flags = recorded_flags(script, tmp_path, {"GPUS_PER_NODE": str(gpus), "TENSORBOARD_DIR": str(tmp_path / "tb")})
    args = parse_args(flags, add_difflm_args, world_size=gpus)
    assert (args.train_iters, args.lr_warmup_iters, args.lr_wsd_decay_iters) == DEFAULT_SCHEDULES[script]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_short_run_validates_with_train_iters_alone(script, tmp_path, monkeypatch):
    """CHECK_ONLY=1 TRAIN_ITERS=25: the script's own flag check passes, the warmup and decay scaled down."""
    import os
    import subprocess

    from tests.launch_flags import ROOT

    for name in SCHEDULE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = dict(os.environ, CHECK_ONLY="1", TRAIN_ITERS="25", GPUS_PER_NODE=str(SCRIPTS[script][0]),
               TENSORBOARD_DIR=str(tmp_path / "tb"))
    result = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CHECK_ONLY=1: not launched" in result.stdout
    flags = recorded_flags(script, tmp_path, {"TRAIN_ITERS": "25", "GPUS_PER_NODE": str(SCRIPTS[script][0]),
                                              "TENSORBOARD_DIR": str(tmp_path / "tb")})
    args = parse_args(flags, add_difflm_args, world_size=SCRIPTS[script][0])
    assert args.train_iters == 25 and args.lr_warmup_iters < 25
    if DEFAULT_SCHEDULES[script][2] is not None:
        assert 0 < args.lr_wsd_decay_iters <= 25 - args.lr_warmup_iters


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_launch_script_flags_validate_at_its_layout(script, tmp_path):
    gpus, expected = SCRIPTS[script]
    flags = recorded_flags(script, tmp_path, {"GPUS_PER_NODE": str(gpus), "TENSORBOARD_DIR": str(tmp_path / "tb")})
    args = parse_args(flags, add_difflm_args, world_size=gpus)
    for name, value in expected.items():
        assert getattr(args, name) == value, (name, getattr(args, name))


def test_the_moe_script_spreads_its_experts_over_the_gpus(tmp_path):
    """EP=4 on 4 GPUs: the [scale] issue's expert-parallel run."""
    flags = recorded_flags("examples/dlm_training/dlm_pretrain_olmoe_1b_7b.sh", tmp_path,
                           {"GPUS_PER_NODE": "4", "EP": "4", "TENSORBOARD_DIR": str(tmp_path / "tb")})
    args = parse_args(flags, add_difflm_args, world_size=4)
    assert (args.expert_model_parallel_size, args.data_parallel_size, args.num_experts) == (4, 4, 64)
    assert args.moe_token_dispatcher_type == "alltoall" and args.padded_vocab_size >= 50304


@pytest.mark.parametrize("script,env", [("examples/quickstart.sh", {"MOCK_DATA": "1", "NPROC": "2"}),
                                        ("examples/dlm_training/dlm_pretrain_7b.sh", {"GPUS_PER_NODE": "8"})])
def test_a_bad_flag_is_one_line_before_torchrun_starts(script, env, tmp_path):
    """The scripts validate the flags once (--check-args) before torchrun: one line and exit 2, not a line
    per worker and torchrun's ChildFailedError report."""
    import os
    import subprocess

    from tests.launch_flags import ROOT

    env = dict(os.environ, **env, TENSORBOARD_DIR=str(tmp_path / "tb"), EXTRA_ARGS="--no-such-flag")
    result = subprocess.run(["bash", script, "--no-such-flag"] if "quickstart" in script else ["bash", script],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["pretrain_difflm.py: error: unrecognized argument --no-such-flag "
                                          "(docs/megatron_compatibility.md lists every flag we accept)"]


def test_check_args_validates_and_exits_without_training(capsys):
    import pretrain_difflm
    from tests.unit_tests.test_bad_inputs_training import TINY

    assert pretrain_difflm.main(TINY + ["--check-args"]) is None
    assert "iteration" not in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--no-such-flag"], ["--train-iters", "0"], ["--seq-length", "x"]])
def test_only_rank_zero_prints_a_flag_error(extra, capsys, monkeypatch):
    """Workers that parse bad flags themselves (torchrun without the scripts' check) say it once."""
    from tests.unit_tests.test_bad_inputs_training import TINY

    for rank, prints in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            parse_args(TINY + extra, add_difflm_args, world_size=2)
        assert exit_info.value.code == 2
        assert bool(capsys.readouterr().err.strip()) == prints, rank


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_a_train_iters_that_is_no_count_is_one_line(value, tmp_path):
    import os
    import subprocess

    from tests.launch_flags import ROOT

    env = dict(os.environ, CHECK_ONLY="1", TRAIN_ITERS=value, TENSORBOARD_DIR=str(tmp_path / "tb"))
    result = subprocess.run(["bash", "examples/dlm_training/dlm_pretrain_125m.sh"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"TRAIN_ITERS={value} is not a positive number of iterations; "
                                          "set it to one (e.g. TRAIN_ITERS=25)"]


def test_the_ar_to_dlm_recipe_scales_its_curriculum_and_takes_the_confidence_loss(tmp_path):
    """TRAIN_ITERS=25: the curriculum's iterations scaled (entries landing together keep the later size);
    CONFIDENCE_LOSS_WEIGHT swaps the masked-only loss for the full-logits one the confidence term reads."""
    script = "examples/dlm_training/ar_to_dlm_1.7b.sh"
    env = {"TRAIN_ITERS": "25", "GPUS_PER_NODE": "1", "TENSORBOARD_DIR": str(tmp_path / "tb"),
           "CONFIDENCE_LOSS_WEIGHT": "0.5"}
    args = parse_args(recorded_flags(script, tmp_path, env), add_difflm_args, world_size=1)
    assert args.difflm_block_size_schedule == ((0, 4), (1, 64), (2, 4096), (22, 32))
    assert args.difflm_confidence_loss_weight == 0.5 and not args.difflm_masked_only_loss


def test_the_ar_to_dlm_recipe_from_a_hugging_face_model_needs_a_corpus(tmp_path):
    import os
    import subprocess

    from tests.launch_flags import ROOT

    env = dict(os.environ, CHECK_ONLY="1", HF_MODEL=str(tmp_path / "qwen3"), GPUS_PER_NODE="1",
               TENSORBOARD_DIR=str(tmp_path / "tb"))
    env.pop("DATA_PATH", None)
    result = subprocess.run(["bash", "examples/dlm_training/ar_to_dlm_1.7b.sh"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().endswith("tokenized with its tokenizer "
                                                                      "(tools/preprocess_data.py)")


def test_the_rl_script_validates_at_its_layout(tmp_path):
    """examples/rl/dlm_grpo_1.7b.sh: 8 data-parallel replicas, each with whole groups of completions."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "What is 2 + 3?", "answer": "5", "reward": "numeric"}\n')
    env = {"GPUS_PER_NODE": "8", "TENSORBOARD_DIR": str(tmp_path / "tb"), "RL_TASK": str(tasks),
           "RL_VALID_TASK": str(tasks)}
    flags = recorded_flags("examples/rl/dlm_grpo_1.7b.sh", tmp_path, env, entry="posttrain_rl.py")
    args = parse_args(flags, add_rl_args, world_size=8)
    update, rollout = rl_settings(args)
    assert (args.data_parallel_size, args.data_parallel_sharding_strategy, args.mock_data) == (8, "optim", True)
    assert (update.estimator, update.clip_high, rollout.group_size, rollout.block_length) == ("diffu_grpo", 0.28, 8, 32)
    assert args.global_batch_size // (8 * rollout.group_size) == 4  # prompts a replica samples each step
