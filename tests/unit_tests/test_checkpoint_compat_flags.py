"""Megatron-LM's and MegaDLMs' checkpoint flags: non-persistent checkpoints (global and local),
--ckpt-step, --checkpoint-steps, --exit-on-missing-checkpoint, --no-save-rng, the format checks,
and the DCP planner options (fully parallel save, constant structure). Tiny runs, in-process."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.training.arguments import parse_args

TINY = ["--num-layers", "1", "--hidden-size", "16", "--ffn-hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--mock-data", "--vocab-size", "60", "--add-mask-token", "--lr", "1e-3",
        "--hidden-dropout", "0.1", "--log-interval", "1000", "--eval-iters", "0", "--attention-backend", "math"]
GLOBAL = ["--non-persistent-ckpt-type", "global"]


def train(*flags):
    """One in-process run of the real entry point: (losses by iteration, the trainer)."""
    trainer = pretrain_difflm.main(TINY + list(flags))
    first = trainer.state.iteration - len(trainer.history) + 1
    return {first + i: result.loss for i, result in enumerate(trainer.history)}


def iterations(root: Path) -> list:
    return sorted(int(p.name[5:]) for p in Path(root).glob("iter_*") if p.name[5:].isdigit())


def copy_iteration(source: Path, iteration: int, root: Path) -> Path:
    name = f"iter_{iteration:07d}"
    shutil.copytree(Path(source) / name, Path(root) / name)
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return Path(root)


def error_of(argv, capsys) -> tuple:
    with pytest.raises(SystemExit) as exit_info:
        pretrain_difflm.main(TINY + argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return exit_info.value.code, lines[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 iterations: persistent saves at 2, 4, 6, a global non-persistent one at 3."""
    root = tmp_path_factory.mktemp("straight")
    losses = train("--train-iters", "6", "--save", str(root / "ckpt"), "--save-interval", "2",
                   "--non-persistent-save-interval", "3", *GLOBAL)
    return losses, root / "ckpt"


def test_global_non_persistent_checkpoints_resume_and_the_newer_one_wins(straight, tmp_path, capsys):
    losses, ckpt = straight
    assert iterations(ckpt) == [2, 4, 6] and iterations(ckpt / "non_persistent") == [3]
    assert (ckpt / "non_persistent" / "latest_checkpointed_iteration.txt").read_text() == "3"
    # Persistent 2 and non-persistent 3: the newer one, and the uninterrupted run's losses after it.
    resume = copy_iteration(ckpt, 2, tmp_path / "a")
    shutil.copytree(ckpt / "non_persistent", resume / "non_persistent")
    capsys.readouterr()
    resumed = train("--train-iters", "6", "--load", str(resume), "--save", str(resume), "--save-interval", "4",
                    "--non-persistent-save-interval", "1", "--keep-last-checkpoints", "1", *GLOBAL)
    assert "at iteration 3 (the non-persistent checkpoint" in capsys.readouterr().out
    assert resumed == {step: losses[step] for step in (4, 5, 6)}
    # Saves at 5 and 6 left only the newest non-persistent one; --keep-last-checkpoints never counted it.
    assert iterations(resume / "non_persistent") == [6] and iterations(resume) == [6]
    # A newer persistent checkpoint (4) wins over the non-persistent one (3).
    newer = copy_iteration(ckpt, 4, tmp_path / "b")
    shutil.copytree(ckpt / "non_persistent", newer / "non_persistent")
    assert train("--train-iters", "6", "--load", str(newer), *GLOBAL) == {5: losses[5], 6: losses[6]}


def test_an_incomplete_non_persistent_save_never_shadows_the_persistent_checkpoint(straight, tmp_path, capsys):
    losses, ckpt = straight
    resume = copy_iteration(ckpt, 4, tmp_path / "c")
    broken = resume / "non_persistent"
    (broken / "iter_0000005.tmp").mkdir(parents=True)  # a save that died: no tracker entry
    (broken / "iter_0000005.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (broken / "iter_0000006").mkdir()  # a tracker naming an iteration without its metadata
    (broken / "latest_checkpointed_iteration.txt").write_text("6")
    assert train("--train-iters", "6", "--load", str(resume), *GLOBAL) == {5: losses[5], 6: losses[6]}
    assert "ignoring the non-persistent checkpoint" in capsys.readouterr().err


def test_local_non_persistent_checkpoint_resumes_under_its_layout_only(tmp_path, capsys):
    local = tmp_path / "node_local"
    flags = ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local)]
    losses = train("--train-iters", "4", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                   "--non-persistent-save-interval", "3", *flags)
    rank_dir = local / "rank_00000"
    assert iterations(rank_dir) == [3] and {p.name for p in (rank_dir / "iter_0000003").iterdir()} == {
        "shards.pt", "rng.pt", "metadata.json"}
    resume = copy_iteration(tmp_path / "ckpt", 2, tmp_path / "resume")
    capsys.readouterr()
    assert train("--train-iters", "4", "--load", str(resume), *flags) == {4: losses[4]}
    assert "(the local non-persistent checkpoint" in capsys.readouterr().out
    metadata_path = rank_dir / "iter_0000003" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["local_layout"]["tensor_model_parallel_size"] = 2  # as if another layout had written it
    metadata_path.write_text(json.dumps(metadata))
    code, line = error_of(["--train-iters", "4", "--load", str(resume), *flags], capsys)
    assert code == 1 and "loads only under the layout that wrote it" in line


def test_ckpt_step_loads_that_iteration_and_names_the_saved_ones_otherwise(straight, capsys):
    losses, ckpt = straight
    assert train("--train-iters", "6", "--load", str(ckpt), "--ckpt-step", "4") == {5: losses[5], 6: losses[6]}
    code, line = error_of(["--train-iters", "6", "--load", str(ckpt), "--ckpt-step", "5", *GLOBAL], capsys)
    assert code == 1 and "--ckpt-step 5" in line and "2, 4, 6" in line and ": 3" in line


def test_checkpoint_steps_save_exactly_those_and_no_save_rng_leaves_the_rng_out(tmp_path):
    ckpt = tmp_path / "ckpt"
    train("--train-iters", "4", "--save", str(ckpt), "--checkpoint-steps", "1,3,", "--no-save-rng")
    assert iterations(ckpt) == [1, 3, 4]  # and the end of training
    for iteration in (1, 3, 4):
        assert not (ckpt / f"iter_{iteration:07d}" / "rng").exists()
    # Such a checkpoint loads; the run keeps its own RNG.
    assert sorted(train("--train-iters", "5", "--load", str(ckpt))) == [5]


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    code, line = error_of(["--train-iters", "1", "--load", str(tmp_path), "--exit-on-missing-checkpoint"], capsys)
    assert code == 1 and "--exit-on-missing-checkpoint" in line and str(tmp_path) in line


@pytest.mark.parametrize("name", ["iter_0000005/mp_rank_00/model_optim_rng.pt",
                                  "release/mp_rank_00_000/model_optim_rng.pt"])
def test_a_legacy_megatron_checkpoint_needs_finetune_and_a_damaged_one_is_named(name, tmp_path, capsys):
    """Megatron-LM's legacy torch format (per-rank files; reading it: test_megatron_lm_checkpoint.py)."""
    (tmp_path / name).parent.mkdir(parents=True)
    (tmp_path / name).write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release" if name.startswith("release/") else "5")
    code, line = error_of(["--train-iters", "1", "--load", str(tmp_path), "--auto-detect-ckpt-format"], capsys)
    assert code == 1 and "is a Megatron-LM checkpoint: add --finetune" in line
    code, line = error_of(["--train-iters", "1", "--load", str(tmp_path), "--finetune"], capsys)
    assert code == 1 and "model_optim_rng.pt: cannot be read safely" in line


def test_a_megatron_torch_dist_checkpoint_needs_finetune(tmp_path, capsys):
    """Its weights load (test_megatron_lm_checkpoint.py); its optimizer state and progress do not."""
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000005" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    code, line = error_of(["--train-iters", "1", "--load", str(tmp_path)], capsys)
    assert code == 1 and "is a Megatron-LM checkpoint: add --finetune" in line


@pytest.mark.parametrize("extra, words", [
    (["--ckpt-format", "torch"], "--ckpt-format torch: only torch_dist"),
    (["--ckpt-format", "zarr"], "--ckpt-format zarr: only torch_dist"),
    (["--ckpt-convert-format", "torch", "--ckpt-convert-save", "x"], "tools/weights_conversion"),
    (["--save", "S", "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "in_memory"],
     "in_memory is not supported"),
    (["--save", "S", "--non-persistent-save-interval", "2"], "--non-persistent-save-interval has no effect without"),
    (["--non-persistent-ckpt-type", "local", "--load", "L"], "needs --non-persistent-local-ckpt-dir"),
    (["--checkpoint-steps", "10,x", "--save", "S"], "'x' is not a positive iteration"),
    (["--ckpt-step", "3"], "--ckpt-step has no effect without --load DIR")])
def test_refused_checkpoint_flags_exit_2_with_one_line(extra, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY + ["--train-iters", "1"] + extra, add_difflm_args, world_size=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2 and len(lines) == 1 and words in lines[0], lines


def test_megadlms_launch_flags_parse(tmp_path):
    args = parse_args(TINY + ["--train-iters", "1", "--save", str(tmp_path), "--load", str(tmp_path),
                              "--save-interval", "4", "--non-persistent-save-interval", "2", *GLOBAL,
                              "--non-persistent-global-ckpt-dir", str(tmp_path / "np"), "--ckpt-format",
                              "torch_dist", "--auto-detect-ckpt-format",
                              "--use-dist-ckpt", "--ckpt-fully-parallel-save"], add_difflm_args, world_size=1)
    assert args.checkpoint_config.non_persistent_global_ckpt_dir == str(tmp_path / "np")


@pytest.mark.parametrize("fully_parallel, items_per_rank", [(True, [4, 4]), (False, [8, 0])])
def test_fully_parallel_save_spreads_replicated_tensors_over_the_ranks(fully_parallel, items_per_rank):
    """DCP's global plan for two data-parallel replicas holding the same eight tensors: each
    tensor is written once, by alternating ranks, or with --no-ckpt-fully-parallel-save by rank 0."""
    from megatron.core.dist_checkpointing import serialization

    state = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}
    plans = []
    for rank in range(2):
        planner = serialization._planner(fully_parallel, cache_plan=False)
        planner.set_up_planner(dict(state), storage_meta=None, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    global_plan, _ = serialization._planner(fully_parallel, cache_plan=False).create_global_plan(plans)
    assert [len(plan.items) for plan in global_plan] == items_per_rank


def test_constant_structure_caches_the_save_plan(tmp_path):
    from torch.distributed.checkpoint.planner import SavePlanner

    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    SavePlanner._cached_save_plan.clear()
    for value in (1.0, 2.0):
        weight = torch.full((4, 4), value)
        serialization.save({"w": ShardedTensor.from_local("w", weight)}, str(tmp_path / str(value)), cache_plan=True)
        assert SavePlanner._cached_save_plan, "the plan is cached after the first save"
        loaded = torch.zeros(4, 4)
        serialization.load({"w": ShardedTensor.from_local("w", loaded)}, str(tmp_path / str(value)))
        assert torch.equal(loaded, weight)
