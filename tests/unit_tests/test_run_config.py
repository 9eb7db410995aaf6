"""RunConfig: pretrain() builds one frozen bundle of typed configs from the flags and hands it, never
the argparse Namespace, to build_trainer and to the entry point's three callbacks."""

import argparse
import ast
import dataclasses
import inspect

import pytest

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.training import run_config as run_config_module
from megatron.training import training
from megatron.training.arguments import parse_args
from megatron.training.run_config import DataConfig, ParallelConfig, PrecisionConfig, RunConfig, run_config
from tests.unit_tests.test_training import TINY

GROUPS = (ParallelConfig, DataConfig, PrecisionConfig)
DERIVED = {"data_parallel_config", "fp8_delayed_scaling"}
"""Fields built from several flags (the others are read from the flag of their own name)."""


def recording(received, name, function, position):
    """`function`, recording (name, the config it received) at each call; the config is argument `position`
    or the keyword `config` (build_trainer passes it to forward_step so)."""
    def wrapper(*args, **kwargs):
        received.append((name, kwargs["config"] if "config" in kwargs else args[position]))
        return function(*args, **kwargs)
    return wrapper


def test_pretrain_hands_build_trainer_and_the_callbacks_one_run_config(runtime, monkeypatch):
    received = []
    monkeypatch.setattr(training, "build_trainer", recording(received, "build_trainer", training.build_trainer, 0))
    argv = TINY + ["--train-iters", "2", "--eval-iters", "1", "--eval-interval", "1", "--seq-length", "24"]
    trainer = training.pretrain(
        recording(received, "datasets", pretrain_difflm.train_valid_test_datasets_provider, 0),
        recording(received, "model", pretrain_difflm.model_provider, 0),
        recording(received, "forward_step", pretrain_difflm.forward_step, 3),
        extra_args_provider=add_difflm_args, argv=argv)
    assert trainer.state.iteration == 2
    assert [name for name, _ in received[:3]] == ["build_trainer", "model", "datasets"]
    assert {name for name, _ in received[3:]} == {"forward_step"}  # training and validation steps
    bundle = received[0][1]
    assert isinstance(bundle, RunConfig) and all(config is bundle for _, config in received)
    assert not any(isinstance(config, argparse.Namespace) for _, config in received)
    assert bundle.data.seq_length == 24 and bundle.training.train_iters == 2 and bundle.model.num_layers == 2


def test_build_trainer_refuses_the_namespace(runtime):
    args = parse_args(TINY + ["--train-iters", "1"], add_difflm_args, world_size=1)
    with pytest.raises(TypeError, match="RunConfig"):
        training.build_trainer(args, runtime, pretrain_difflm.train_valid_test_datasets_provider,
                               pretrain_difflm.model_provider, pretrain_difflm.forward_step)


def test_the_bundle_is_frozen_and_holds_the_flags_values():
    args = parse_args(TINY + ["--train-iters", "1", "--reset-position-ids", "--eod-mask-loss", "--split", "90,10,0"],
                      add_difflm_args, world_size=1)
    config = run_config(args)
    for group in GROUPS:  # each field is the flag of its name: a misspelt field would silently keep its default
        part = next(getattr(config, f.name) for f in dataclasses.fields(RunConfig) if f.type == group.__name__)
        for field in dataclasses.fields(group):
            if field.name not in DERIVED:
                assert hasattr(args, field.name), f"{group.__name__}.{field.name} is no flag's destination"
                assert getattr(part, field.name) == getattr(args, field.name), field.name
    assert config.data.reset_position_ids and config.data.eod_mask_loss and config.data.split == "90,10,0"
    assert config.model is args.transformer_config and config.dlm is args.dlm_config
    assert config.parallel.data_parallel_config is args.data_parallel_config
    for part, name in ((config, "data"), (config.data, "seq_length"), (config.parallel, "world_size"),
                       (config.precision, "fp8_format")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, name, None)
    with pytest.raises(TypeError):
        config.lr_schedule["max_lr"] = 1.0
    assert config.lr_schedule["max_lr"] == args.lr


def test_every_field_of_the_bundle_has_a_docstring():
    sources = (inspect.getsource(run_config_module), inspect.getsource(inspect.getmodule(PrecisionConfig)))
    classes = [node for source in sources for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]
    assert {c.__name__ for c in GROUPS + (RunConfig,)} <= {node.name for node in classes}
    for node in classes:
        if isinstance(node, ast.ClassDef) and node.name in {c.__name__ for c in GROUPS + (RunConfig,)}:
            body = node.body
            for statement, following in zip(body, body[1:] + [None]):
                if isinstance(statement, ast.AnnAssign):
                    documented = (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                                  and isinstance(following.value.value, str))
                    assert documented, f"{node.name}.{statement.target.id} has no docstring"
