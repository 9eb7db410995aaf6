"""tools/weights_conversion/to_megatron.py: our checkpoint written as Megatron-LM's torch_dist checkpoint.

Against megatron-core's own files: the checkpoints megatron-core saved (tests/assets/megatron/), read into our
model, saved as ours and exported again, give megatron-core's keys (its `_extra_state` entries too) and its
tensors bit for bit, so its loader reads them as it reads its own. The round trip ours -> Megatron-LM -> ours
is bit-exact, architecture flags included. (megatron-core itself loading an export: make_assets.py
--check-export, run where megatron-core is installed; see its docstring.)"""

import argparse
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.training.checkpoint_args import ARCHITECTURE_FIELDS, FUNCTION_FIELDS
from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict
from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.errors import InputError
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.training.megatron_lm_checkpoint import (load_megatron_lm_model, megatron_lm_architecture,
                                                      megatron_lm_args_for, megatron_lm_iteration_dir,
                                                      read_megatron_lm_args)
from megatron.training.run_config import parse_run_config
from tests.unit_tests.test_megatron_lm_checkpoint import ASSETS, load
from tools.weights_conversion import checkpoint_io, to_megatron


def stored(folder: str) -> dict:
    """{key: tensor or loaded object} of a torch_dist iteration folder, read whole."""
    index = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    state = {key: torch.empty(item.size, dtype=item.properties.dtype) if hasattr(item, "size") else None
             for key, item in index.items()}
    objects = [key for key, value in state.items() if value is None]
    state = {key: value for key, value in state.items() if value is not None}
    dcp.load(state, storage_reader=SafeFileSystemReader(folder))
    loaded = {key: None for key in objects}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(folder))
    return {**state, **loaded}


def save_ours(model: GPTModel, folder: Path) -> None:
    """`model`'s weights as our checkpoint (iteration 1) in our global shapes, as training saves them."""
    tensors = {piece.key: piece.data.detach().clone() for piece in model_sharded_state_dict(model, prefix="").values()}
    metadata = checkpoint_io.metadata_for(model.config, model.dlm_config, 1, None, 32, {"test": "asset"}, iteration=1)
    checkpoint_io.write_checkpoint(str(folder), tensors, metadata)


@pytest.mark.parametrize("case", ["dense", "dense_gpt", "dense_gpt_learned", "moe", "moe_mixed_shared"])
def test_the_export_of_megatron_cores_weights_is_megatron_cores_checkpoint(runtime, case, tmp_path):
    """The Llama style, Megatron's GPT defaults (with RoPE, and with its learned position table), a mixture of
    experts (its router, SequentialMLP's experts) and MoE layers among dense ones with a shared expert (each
    layer under its own keys, as megatron-core writes layers that differ): a wrong key, row order, stacking or
    missing object fails."""
    save_ours(load(case), tmp_path / "ours")
    assert to_megatron.main(["--load", str(tmp_path / "ours"), "--save", str(tmp_path / "megatron")]) == 0
    theirs = stored(str(ASSETS / case / "iter_0000001"))
    exported = stored(megatron_lm_iteration_dir(str(tmp_path / "megatron")))
    assert sorted(exported) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(exported[key], value), key
        else:  # the local spec's linear layers: [None]
            assert exported[key] == value, key
    recorded = read_megatron_lm_args(megatron_lm_iteration_dir(str(ASSETS / case)))
    written = read_megatron_lm_args(megatron_lm_iteration_dir(str(tmp_path / "megatron")))
    assert megatron_lm_architecture(written) == megatron_lm_architecture(recorded)


QWEN2_STYLE = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
               "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
               "--disable-bias-linear", "--add-qkv-bias", "--apply-layernorm-1p", "--rotary-base", "500000",
               "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6", "--max-position-embeddings", "32"]


def test_ours_to_megatron_and_back_is_bit_exact(runtime, tmp_path, capsys):
    """A DLM trained here (QKV bias without other biases, LayerNorm-1p scales, another RoPE base), exported,
    then loaded with --use-checkpoint-args: the same architecture, running mode and mask token (recorded in
    common.pt as MegaDLMs records them; not given again) and every weight to the bit."""
    data = ["--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "1", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0", "--attention-backend", "math"]
    dlm = ["--model-running-mode", "difflm-shift", "--mask-token", "5"]  # not the defaults (noshift, tokenizer's)
    trainer = pretrain_difflm.main(QWEN2_STYLE + data + dlm + ["--train-iters", "2", "--eval-iters", "0", "--save",
                                                               str(tmp_path / "ours"), "--save-interval", "2"])
    assert to_megatron.main(["--load", str(tmp_path / "ours"), "--save", str(tmp_path / "megatron")]) == 0
    # what Megatron-LM's --use-checkpoint-args leaves out and this model sets differently from its defaults
    assert ("note: Megatron-LM's --use-checkpoint-args does not restore --apply-layernorm-1p --norm-epsilon 1e-06: "
            in capsys.readouterr().out)
    config = parse_run_config(["--load", str(tmp_path / "megatron"), "--use-checkpoint-args", "--finetune",
                               "--train-iters", "2"] + data, add_difflm_args, world_size=1)
    fields = [*ARCHITECTURE_FIELDS, *FUNCTION_FIELDS, "vocab_size", "max_position_embeddings"]
    assert [getattr(config.model, f) for f in fields] == [getattr(trainer.model.config, f) for f in fields]
    assert (config.dlm.model_running_mode, config.dlm.mask_token_id) == ("difflm-shift", 5)
    back = GPTModel(config.model, config.dlm)
    load_megatron_lm_model(back, str(tmp_path / "megatron"))
    ours = dict(trainer.model.named_parameters())
    for name, parameter in back.named_parameters():
        assert torch.equal(parameter, ours[name]), name
    args = read_megatron_lm_args(megatron_lm_iteration_dir(str(tmp_path / "megatron")))
    assert (args.model_running_mode, args.mask_token, args.iteration) == ("difflm-shift", 5, 2)


def test_an_existing_save_folder_or_an_unwritable_architecture_is_one_line(runtime, tmp_path, capsys):
    save_ours(load("dense"), tmp_path / "ours")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    assert to_megatron.main(["--load", str(tmp_path / "ours"), "--save", str(tmp_path / "taken")]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--save" in error and "not empty" in error
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]
    assert not list(tmp_path.glob("taken.tmp-*"))
    config = dict(checkpoint_io.read_metadata(str(tmp_path / "ours" / "iter_0000001"))["transformer_config"])
    for change, named in [({"moe": {"num_experts": 4, "router_type": "expert_choice"}}, "expert_choice router"),
                          ({"qk_layernorm_scope": "all"}, "scope all"),
                          ({"activation": "relu"}, "activation")]:
        with pytest.raises(InputError, match=named):
            megatron_lm_args_for({**config, **change}, 1, 32)


def test_a_megatron_lm_flag_this_model_cannot_compute_is_refused_on_load():
    args = read_megatron_lm_args(megatron_lm_iteration_dir(str(ASSETS / "dense")))
    for flag in ("squared_relu", "rotary_interleaved"):
        with pytest.raises(InputError, match=flag.replace("_", "-")):
            megatron_lm_architecture(argparse.Namespace(**{**vars(args), flag: True}))
