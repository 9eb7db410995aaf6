"""Checkpoints across pipeline, context- and expert-parallel layouts: a checkpoint saved under one
layout continues under another, and a pipeline checkpoint exports to Hugging Face as a one-process
checkpoint of the same weights does.

Layers are keyed by global index and the last stage's copy of a tied word embedding is saved under
the embedding's own key, and experts as global `[E, ...]` tensors, so a checkpoint does not depend
on the layout that wrote it. Each writer
below is one real `examples/quickstart.sh` run of ITERS iterations that also saves at iteration 6:
its losses are the uninterrupted run, its iteration-8 checkpoint the state a continuation must
reach (weights and AdamW moments), its iteration-6 checkpoint what the continuations load. No
dropout: its streams differ between layouts. (Bit-exact resume under the same pipeline layout, with
dropout and evaluation, is the `pp2_tp2_sp_dlm` case of test_checkpoint_resume.py.)
"""

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.test_checkpoint_resume import SMALLER, checkpoint_at, train

pytestmark = pytest.mark.distributed

ITERS, SAVED = 8, 6
# SMALLER with 4 layers (one per stage under PP=4, one per virtual stage under PP=2 x 2) and
# 4 micro-batches per step under every layout here (micro-batch 2, global batch 8, DP=1); the
# later flag wins. A warmup shorter than the quickstart's 10 iterations, which exceed ITERS.
MODEL = [*SMALLER, "--num-layers", "4", "--micro-batch-size", "2", "--lr-warmup-iters", "2"]
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
INTERLEAVED = [*PP2, "--num-virtual-stages-per-pipeline-rank", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
UNTIED = ["--untie-embeddings-and-output-weights"]  # the quickstart ties them (no flag)
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
# 4 experts of ffn 64, top-2, in every layer, with the load-balancing loss.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall"]
PIPELINE_WRITERS = ["pp2_interleaved_tied", "tp2_sp_pp2_untied"]
WRITERS = {  # name: (processes, flags)
    "pp2_interleaved_tied": (2, INTERLEAVED),
    "tp2_sp_pp2_untied": (4, TP2_SP + PP2 + UNTIED),
    "cp2_tied": (2, CP2),
    "ep2_moe": (2, MOE + ["--expert-model-parallel-size", "2"]),
}
LAYOUT_CHANGES = {  # name: (writer, processes, flags of the continuation)
    "pp2_interleaved_to_pp1": ("pp2_interleaved_tied", 1, []),
    "pp2_interleaved_to_pp4": ("pp2_interleaved_tied", 4, PP4),
    "tp2_sp_pp2_to_tp1_pp4": ("tp2_sp_pp2_untied", 4, PP4 + UNTIED),
    "cp2_to_cp1": ("cp2_tied", 1, []),
    "cp2_to_cp4": ("cp2_tied", 4, CP4),
    "ep2_to_ep1": ("ep2_moe", 1, MOE),
    # EP=4 carved out of TP=2 x DP=2: each rank holds one expert; the dense weights split over tp.
    "ep2_to_ep4_tp2_sp": ("ep2_moe", 4, MOE + ["--expert-model-parallel-size", "4"] + TP2_SP),
}


@pytest.fixture(scope="module")
def writers(tmp_path_factory):
    """writers(name) -> (losses of the uninterrupted run, its --save directory); each run once."""
    runs = {}

    def run(name: str):
        if name not in runs:
            nproc, flags = WRITERS[name]
            root = tmp_path_factory.mktemp(name)
            losses, _ = train(root, nproc, *MODEL, *flags, "--save", str(root / "ckpt"), "--save-interval",
                              str(SAVED), iters=ITERS)
            assert sorted(losses) == list(range(1, ITERS + 1)), losses
            runs[name] = ({step: float(loss) for step, loss in losses.items()}, root / "ckpt")
        return runs[name]

    return run


def saved_state(ckpt: Path) -> dict:
    """Every tensor of the latest iteration of `ckpt`, whole: the weights (`model.*`) and the AdamW
    moments (`optimizer.exp_avg.*`, `optimizer.exp_avg_sq.*`), however they were sharded."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader

    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    iter_dir = str(ckpt / f"iter_{iteration:07d}")
    index = SafeFileSystemReader(iter_dir).read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in index.items() if hasattr(item, "size")}
    with warnings.catch_warnings():  # DCP notes that it loads without a process group: intended
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeFileSystemReader(iter_dir))
    return state


@pytest.mark.parametrize("case", list(LAYOUT_CHANGES))
def test_checkpoint_continues_under_another_layout(case, writers, tmp_path):
    """Iterations 7 and 8 after loading iteration 6 under another layout: the losses within 1e-5 of
    the uninterrupted run (iteration 8's needs the loaded AdamW moments and schedule, not only the
    weights), and the final weights and moments those of the uninterrupted run."""
    writer, nproc, flags = LAYOUT_CHANGES[case]
    straight, ckpt = writers(writer)
    source = checkpoint_at(ckpt, SAVED, tmp_path / "source")
    resumed, out = train(tmp_path, nproc, *MODEL, *flags, "--load", str(source), "--save", str(tmp_path / "resumed"),
                         iters=ITERS)
    assert f"> loaded {source} at iteration {SAVED}" in out
    assert sorted(resumed) == list(range(SAVED + 1, ITERS + 1)), resumed
    for step, loss in resumed.items():
        assert float(loss) == pytest.approx(straight[step], rel=1e-5), f"{case}: lm loss of iteration {step}"
    expected, continued = saved_state(ckpt), saved_state(tmp_path / "resumed")
    assert expected.keys() == continued.keys()
    moments = [key for key in expected if key.startswith("optimizer.exp_avg")]
    assert len(moments) == 2 * sum(key.startswith("model.") for key in expected), "a moment per weight, twice"
    # Vocabulary tensors are stored with the writer's padding (it depends on tp): compare the real rows.
    vocab = json.loads((ckpt / f"iter_{ITERS:07d}" / "metadata.json").read_text())["transformer_config"][
        "unpadded_vocab_size"]
    for key, tensor in expected.items():  # relative to the tensor's scale: second moments are ~1e-9
        if key.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
            tensor, continued[key] = tensor[:vocab], continued[key][:vocab]
        difference = (continued[key] - tensor).abs().max().item()
        assert difference <= 1e-5 * tensor.abs().max().item(), f"{case}: {key} differs by {difference:.3e}"


def one_process_copy(ckpt: Path, save: Path) -> Path:
    """The latest iteration of `ckpt` as a PP=1 run sees it (read into one process's GPTModel by the
    framework's loader), written back by that one process with a one-process run's metadata."""
    from tools.weights_conversion import checkpoint_io

    model, metadata, _ = checkpoint_io.load_model(str(ckpt))
    tensors = {}
    for piece in model.sharded_state_dict(prefix=checkpoint_io.MODEL_PREFIX).values():
        assert tuple(piece.data.shape) == tuple(piece.global_shape), piece.key  # one process holds it whole
        tensors[piece.key[len(checkpoint_io.MODEL_PREFIX):]] = piece.data
    metadata["layout"] = {"world_size": 1, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
                          "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None}
    metadata["transformer_config"].update(sequence_parallel=False)
    checkpoint_io.write_checkpoint(str(save), tensors, metadata)
    return save


def export(ckpt: Path, hf_dir: Path) -> tuple:
    """(config.json without its provenance, {HF name: tensor}) of `ckpt`'s fp32 export."""
    from safetensors.torch import load_file

    from tools.weights_conversion import megatron_to_hf

    assert megatron_to_hf.main(["--load", str(ckpt), "--save", str(hf_dir), "--dtype", "float32",
                                "--no-progress"]) == 0
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("megadlms")  # where it came from: the two exports' sources differ on purpose
    tensors = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return config, tensors


@pytest.mark.parametrize("writer", PIPELINE_WRITERS)
def test_export_of_a_pipeline_checkpoint_equals_the_one_process_export(writer, writers, tmp_path):
    """megatron_to_hf of a PP=2 checkpoint (interleaved with the tied embedding saved by the first and
    last stage; or TP=2 x PP=2 with the output layer on the last stage only): bit for bit the export
    of the same weights saved by one process, and its logits and loss those of the checkpoint loaded
    in one process (verify_correctness_dlm, the transformers model from the export's remote code)."""
    _, ckpt = writers(writer)
    metadata = json.loads((ckpt / f"iter_{ITERS:07d}" / "metadata.json").read_text())
    assert metadata["layout"]["pipeline_model_parallel_size"] == 2
    pipeline_config, pipeline_tensors = export(ckpt, tmp_path / "hf_pp2")
    one_config, one_tensors = export(one_process_copy(ckpt, tmp_path / "pp1"), tmp_path / "hf_pp1")
    assert pipeline_config == one_config
    assert pipeline_tensors.keys() == one_tensors.keys()
    # The embedding, the final norm, 11 tensors per layer, and lm_head when untied.
    assert len(pipeline_tensors) == 2 + 11 * 4 + (writer != "pp2_interleaved_tied"), sorted(pipeline_tensors)
    for name, tensor in one_tensors.items():
        assert torch.equal(pipeline_tensors[name], tensor), name
    pytest.importorskip("transformers")  # for the verifier only: the comparison above has run
    from tools.weights_conversion import verify_correctness_dlm

    assert verify_correctness_dlm.main(["--load", str(ckpt), "--hf-path", str(tmp_path / "hf_pp2"),
                                        "--seq-length", "64", "--tolerance", "1e-5"]) == 0
