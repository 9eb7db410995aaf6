"""Megatron-LM's torch_dist checkpoints read as they are: tiny GPT models that megatron-core itself built and
saved (tests/assets/megatron/make_assets.py: its local layer spec, one process and TP=2 / PP=2 layouts) load
into our GPTModel, whose logits then equal the ones megatron-core computed for the same ids (fp32)."""

import argparse
import warnings
from pathlib import Path

import pytest
import torch

from custom_args.difflm import add_difflm_args
from megatron.core.errors import InputError
from megatron.core.models.difflm.gpt_model import GPTModel
import pretrain_difflm
from megatron.core.dist_checkpointing.safe_torch_file import ForeignObject
from megatron.training.megatron_lm_checkpoint import (load_megatron_lm_model,
                                                      megatron_lm_iteration_dir, read_megatron_lm_args)
from megatron.training.run_config import parse_run_config

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "megatron"
RUN = ["--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "1", "--seq-length", "32",
       "--model-running-mode", "vanilla", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
       "--train-iters", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--attention-backend", "math"]


def _configs(folder, extra=()) -> tuple:
    """(model, dlm) configs with the architecture from the checkpoint (--use-checkpoint-args reads its args)."""
    config = parse_run_config(["--load", str(folder), "--use-checkpoint-args", "--finetune"] + RUN + list(extra),
                              add_difflm_args, world_size=1)
    return config.model, config.dlm


def load(case: str, extra=()) -> GPTModel:
    """The architecture from the checkpoint (--use-checkpoint-args reads common.pt), then its weights."""
    model = GPTModel(*_configs(ASSETS / case, extra))
    torch.nn.init.zeros_(model.embedding.word_embeddings.weight)  # whatever it held is replaced
    assert load_megatron_lm_model(model, str(ASSETS / case)).num_layers == 2
    return model.eval()


@pytest.mark.parametrize("case, reference", [
    ("dense", "dense"), ("dense_gpt", "dense_gpt"), ("dense_tp2_pp1", "dense"), ("dense_tp1_pp2", "dense"),
    ("legacy_dense_tp1_pp1", "dense"), ("legacy_dense_tp2_pp1", "dense"), ("legacy_dense_tp1_pp2", "dense"),
    ("legacy_dense_gpt_tp2_pp1", "dense_gpt"), ("moe", "moe"), ("moe_ep2", "moe"),
    ("dense_gpt_learned", "dense_gpt_learned"), ("legacy_dense_gpt_learned_tp2_pp1", "dense_gpt_learned"),
    ("moe_mixed_shared", "moe_mixed_shared"), ("dense_per_layer", "dense"), ("dense_singleton", "dense"),
    ("moe_singleton", "moe"), ("legacy_moe_tp1_pp1_ep2", "moe"),
    ("legacy_moe_mixed_shared_tp2_pp1", "moe_mixed_shared"), ("legacy_gpt_tp1_pp1", "legacy_gpt_tp1_pp1"),
    ("legacy_gpt_tp2_pp1", "legacy_gpt_tp2_pp1"), ("megatron_lm_torch_dist", "megatron_lm_torch_dist"),
    ("megatron_lm_torch", "megatron_lm_torch_dist")])
def test_our_logits_equal_megatron_cores(runtime, case, reference):
    """The Llama style (GQA, QK-norm, SwiGLU, RMSNorm, RoPE, untied) and Megatron's GPT defaults (LayerNorm,
    GeLU, biases, tied; with RoPE, and with its default learned absolute position table); the TP=2 and PP=2
    saves of the first join to the same model; so do the legacy `torch` format's per-rank files (TP=2:
    SwiGLU's gates and ups, row- and column-parallel pieces, biases);
    and a mixture of experts (4 experts, top-2, megatron-core's router and SequentialMLP experts), also after a
    dense layer and with a shared expert (megatron-core then keys each layer apart instead of stacking them, as it
    does for any model saved with its non_homogeneous_layers metadata: the dense one so saved); and both saved with
    its singleton_local_shards metadata (each expert, and a SwiGLU fc1's gate and up rows, under their own keys);
    and in the legacy format, the experts in two expert-parallel ranks' files (each numbering its own from 0),
    and the mixed model's in two tensor-parallel ones (experts and the shared expert split over them too); and
    Megatron-LM's older GPT model (megatron/legacy/model: nested `language_model.*` state dicts; its own logits),
    in one and in two tensor-parallel ranks' files; and checkpoints Megatron-LM's own save_checkpoint wrote in both
    formats (its whole args in common.pt and the rank file), the same weights."""
    expected = torch.load(ASSETS / reference / "logits.pt")
    model = load(case)
    with torch.no_grad():
        logits = model(expected["tokens"])
    torch.testing.assert_close(logits.float(), expected["logits"], rtol=1e-5, atol=1e-5)


def test_megatron_lms_own_load_of_our_export_computes_our_logits(runtime):
    """`ours_exported`: to_megatron.py's export of a model of ours, which Megatron-LM's training code loaded
    (parse_args, load_args_from_checkpoint, load_checkpoint under --finetune --use-checkpoint-args; made_by.txt)
    and ran: its logits are ours (the export's tensors in the places and row orders Megatron-LM reads)."""
    expected = torch.load(ASSETS / "ours_exported" / "megatron_lm_logits.pt")
    model = GPTModel(*_configs(ASSETS / "ours_exported", ["--vocab-size", "128"]))
    load_megatron_lm_model(model, str(ASSETS / "ours_exported"))
    with torch.no_grad():
        logits = model.eval()(expected["tokens"])
    torch.testing.assert_close(logits.float(), expected["logits"], rtol=1e-5, atol=1e-5)


def test_the_args_come_from_common_pt_and_code_is_never_run(tmp_path):
    args = read_megatron_lm_args(megatron_lm_iteration_dir(str(ASSETS / "dense")))
    assert (args.num_layers, args.num_query_groups, args.swiglu, args.ckpt_format) == (2, 2, True, "torch_dist")
    # megatron-core's enum members in the args (as Megatron-LM's pretrain() leaves them): inert stand-ins
    assert isinstance(args.model_type, ForeignObject) and args.model_type.args == (1,)
    assert args.attention_backend.name == "megatron.core.transformer.enums.AttnBackend"
    crafted = tmp_path / "iter_0000001"
    crafted.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    (crafted / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"args": argparse.Namespace(num_layers=2), "hook": _Evil()}, crafted / "common.pt")
    with pytest.raises(InputError, match=r"cannot be read safely \(Unsupported global: GLOBAL print\)"):
        read_megatron_lm_args(str(crafted))


class _Evil:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_a_model_of_another_shape_is_one_line_naming_the_tensor(runtime):
    with pytest.raises(InputError, match=r"--load .*dense: .*linear_fc1.weight' has shape \(128, 32\).*differs"):
        GPTModel_of = parse_run_config(["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48",
                                        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups",
                                        "2", "--normalization", "RMSNorm", "--swiglu", "--qk-layernorm",
                                        "--disable-bias-linear", "--untie-embeddings-and-output-weights"] + RUN,
                                       add_difflm_args, world_size=1)
        load_megatron_lm_model(GPTModel(GPTModel_of.model, GPTModel_of.dlm), str(ASSETS / "dense"))


@pytest.mark.parametrize("ours, box, flat", [
    ((2, 6, 4), ((0, 3, 0), (2, 3, 4)), (12, 4)),  # a TP rank's SwiGLU fc1: its gate rows and its up rows
    ((2, 4, 8, 32), ((1, 0, 0, 0), (1, 4, 8, 32)), (64, 32)),  # a TP rank's query groups of the QKV
    ((2, 4, 8, 32), ((0, 0, 0, 0), (2, 4, 8, 32)), (64, 32)),  # the whole tensor: one block
])
def test_a_pieces_rows_in_the_flattened_tensor(ours, box, flat):
    """Each block row_blocks makes views our piece's data and names where those values sit in the
    checkpoint's flattened tensor (row-major order kept)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.training.megatron_lm_checkpoint import row_blocks

    full = torch.arange(torch.Size(ours).numel(), dtype=torch.float32).view(ours)
    offset, size = box
    data = full[tuple(slice(o, o + n) for o, n in zip(offset, size))].clone()
    blocks = row_blocks(ShardedTensor("w", data, ours, offset), flat)
    flattened = full.reshape(flat)
    covered = 0
    for view, start in blocks:
        assert view.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()  # loads land in the piece
        torch.testing.assert_close(view, flattened[tuple(slice(o, o + n) for o, n in zip(start, view.shape))])
        covered += view.numel()
    assert covered == data.numel() and len(blocks) == (2 if ours == (2, 6, 4) else 1)


def test_pretraining_loads_it_with_finetune_and_trains_it_as_a_dlm(runtime, capsys):
    """`--load MEGATRON_CKPT --finetune --use-checkpoint-args`: the run starts from megatron-core's weights
    (its logits, in AR mode) and trains on as a DLM; without --finetune it is one line."""
    flags = ["--load", str(ASSETS / "dense"), "--use-checkpoint-args", "--mock-data", "--vocab-size", "64",
             "--make-vocab-size-divisible-by", "1", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--lr", "1e-4", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--attention-backend", "math"]
    expected = torch.load(ASSETS / "dense" / "logits.pt")
    trainer = pretrain_difflm.main(flags + ["--finetune", "--model-running-mode", "vanilla", "--train-iters", "1",
                                            "--skip-train", "--eval-iters", "1"])
    with torch.no_grad():
        logits = trainer.model.eval()(expected["tokens"])
    torch.testing.assert_close(logits.float(), expected["logits"], rtol=1e-5, atol=1e-5)
    assert "loaded the weights of Megatron-LM's checkpoint" in capsys.readouterr().out
    # a DLM with a mask token appended to the vocabulary (its row is new; the others are the checkpoint's)
    dlm = pretrain_difflm.main(flags + ["--finetune", "--add-mask-token", "--train-iters", "2", "--eval-iters", "0"])
    assert len(dlm.history) == 2 and all(torch.isfinite(torch.tensor(step.loss)) for step in dlm.history)
    with pytest.raises(SystemExit) as exit_info:
        pretrain_difflm.main(flags + ["--model-running-mode", "vanilla", "--train-iters", "1", "--eval-iters", "0"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 1 and error.count("\n") == 1 and "add --finetune" in error


def test_what_the_legacy_reader_does_not_take_is_one_line(tmp_path):
    """Uneven pipeline stages or a rank's file missing in the legacy torch format: one line before anything is
    read."""
    from megatron.training.megatron_lm_legacy import legacy_global_tensors

    folder = ASSETS / "legacy_dense_tp1_pp2" / "iter_0000001"
    args = read_megatron_lm_args(str(folder))
    for change, words in [({"decoder_first_pipeline_num_layers": 1}, "uneven depth"),
                          ({"expert_model_parallel_size": 2}, "stage 0, expert-parallel rank 1: copy the whole")]:
        with pytest.raises(InputError, match=words):
            legacy_global_tensors(str(folder), argparse.Namespace(**{**vars(args), **change}))


def test_an_older_gpt_model_of_an_old_version_or_another_model_is_one_line(tmp_path):
    """Megatron-LM's older GPT model: a checkpoint_version before 2 (QKV rows in an older order) and a tensor with
    no megatron-core counterpart (a pooler: not a GPT) are refused, naming the file."""
    from megatron.core.dist_checkpointing.safe_torch_file import safe_torch_load
    from megatron.training.megatron_lm_legacy import legacy_global_tensors

    checkpoint = safe_torch_load(str(ASSETS / "legacy_gpt_tp1_pp1" / "iter_0000001" / "mp_rank_00" /
                                     "model_optim_rng.pt"))
    args = argparse.Namespace(**{key: value for key, value in vars(checkpoint["args"]).items()
                                 if not isinstance(value, ForeignObject)})
    pooler = {"pooler": {"dense": {"weight": torch.zeros(2, 2)}}}
    for version, extra, words in [(1.0, {}, "checkpoint_version 1.0 GPT"),
                                  (3.0, pooler, "pooler.dense.weight of Megatron-LM's older GPT model has no")]:
        folder = tmp_path / str(version) / "iter_0000001" / "mp_rank_00"
        folder.mkdir(parents=True)
        model = {"language_model": {**checkpoint["model"]["language_model"], **extra}}
        torch.save({"args": args, "checkpoint_version": version, "iteration": 1, "model": model},
                   folder / "model_optim_rng.pt")
        with pytest.raises(InputError, match=words):
            legacy_global_tensors(str(folder.parent), args)


def test_newer_megatron_lm_norm_arg_names_are_read():
    """megatron-core 0.18-era runs record --norm-epsilon and --apply-layernorm-1p under TransformerConfig's names
    (layernorm_epsilon, layernorm_zero_centered_gamma): a real run's args (the legacy asset's) with other values
    than the defaults give those values, not the defaults."""
    from megatron.core.dist_checkpointing.safe_torch_file import safe_torch_load
    from megatron.training.megatron_lm_checkpoint import megatron_lm_architecture

    recorded = safe_torch_load(str(ASSETS / "megatron_lm_torch" / "iter_0000001" / "mp_rank_00" /
                                   "model_optim_rng.pt"))["args"]
    assert not hasattr(recorded, "norm_epsilon") and not hasattr(recorded, "apply_layernorm_1p")
    recorded.layernorm_epsilon, recorded.layernorm_zero_centered_gamma = 1e-6, True
    architecture = megatron_lm_architecture(recorded)
    assert (architecture["norm_epsilon"], architecture["apply_layernorm_1p"]) == (1e-6, True)


def test_a_copy_under_the_local_modules_names_loads_the_same(runtime, tmp_path):
    """megatron-core 0.16 saves its local spec under Transformer Engine's fused names (`linear_qkv.layer_norm_weight`
    is the input norm): the assets. Earlier releases, and Transformer-Engine-free forks, save the local modules'
    own names (`input_layernorm.weight`, `pre_mlp_layernorm.weight`): a renamed copy of the `dense` asset, stated
    as such, loads to the same logits."""
    import torch.distributed.checkpoint as dcp

    from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader

    source = ASSETS / "dense" / "iter_0000001"
    index = SafeFileSystemReader(str(source)).read_metadata().state_dict_metadata
    state = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in index.items()
             if hasattr(item, "size")}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(source)))
    local = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
    def local_name(key: str) -> str:
        for theirs, ours in local.items():
            key = key.replace(theirs, ours)
        return key

    renamed = {local_name(key): tensor for key, tensor in state.items()}
    assert sum(key.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight")) for key in renamed) == 2
    copy = tmp_path / "local_names"
    target = copy / "iter_0000001"
    with warnings.catch_warnings():  # DCP notes that it runs without a process group here: intended
        warnings.simplefilter("ignore")
        dcp.save(renamed, storage_writer=dcp.FileSystemWriter(str(target)))
    for name in ("common.pt", "metadata.json"):
        (target / name).write_bytes((source / name).read_bytes())
    (copy / "latest_checkpointed_iteration.txt").write_text("1")
    expected = torch.load(ASSETS / "dense" / "logits.pt")
    model = GPTModel(*_configs(copy))
    load_megatron_lm_model(model, str(copy))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(expected["tokens"]).float(), expected["logits"], rtol=1e-5,
                                   atol=1e-5)
