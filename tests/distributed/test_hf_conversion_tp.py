"""A TP=2 training checkpoint -> Hugging Face -> a TP=2 checkpoint again, through the real entry points.

Training (2 gloo processes, sequence parallel, vocabulary padded for TP=2) writes the checkpoint;
the export must load in transformers with our logits, pass verify_correctness_dlm, and convert
back to identical tensors in a real TP=2 layout that pretrain_difflm.py --finetune continues
exactly like the original.
"""

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from megatron.training.checkpoint_files import resolve_checkpoint  # noqa: E402
from tools.weights_conversion import checkpoint_io, hf_to_megatron, megatron_to_hf  # noqa: E402
from tools.weights_conversion import verify_correctness_dlm  # noqa: E402
from tests.distributed.parity import run_entry_point  # noqa: E402

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SPM = str(ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
         "--qk-layernorm", "--disable-bias-linear", "--seq-length", "32", "--rotary-base", "50000",
         "--norm-epsilon", "1e-5", "--untie-embeddings-and-output-weights",
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", SPM, "--mock-data",
         "--model-running-mode", "difflm-shift", "--attention-backend", "math",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
RUN = ["--micro-batch-size", "2", "--lr", "1e-2", "--lr-decay-style", "constant", "--eval-iters", "0",
       "--log-interval", "1"]


def train(nproc: int, *flags: str) -> dict:
    return run_entry_point(nproc, [*MODEL, *RUN, *flags])


def test_tp2_checkpoint_to_hf_and_back(tmp_path):
    original, hf_dir, back = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "back"
    train(2, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "100",
          "--train-iters", "2", "--save", str(original))
    assert megatron_to_hf.main(["--load", str(original), "--save", str(hf_dir), "--dtype", "float32",
                                "--tokenizer-model", SPM, "--no-progress"]) == 0
    ours, metadata, iter_dir = checkpoint_io.load_model(str(original))
    assert metadata["layout"]["tensor_model_parallel_size"] == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    assert type(hf).__name__ == "DLMForCausalLM" and hf.config.model_running_mode == "difflm-shift"
    tokens = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-5
    assert verify_correctness_dlm.main(["--load", str(original), "--hf-path", str(hf_dir), "--seq-length", "32"]) == 0

    assert hf_to_megatron.main(["--hf-path", str(hf_dir), "--save", str(back), "--tensor-model-parallel-size", "2",
                                "--make-vocab-size-divisible-by", "100"]) == 0
    converted = resolve_checkpoint(str(back))[0]
    writers = {name.split("_")[2] for name in os.listdir(converted) if name.endswith(".distcp")}
    assert writers == {"0", "1"}, "both tensor-parallel ranks wrote their shards"
    before, after = checkpoint_io.stored_shapes(iter_dir), checkpoint_io.stored_shapes(converted)
    assert {name: shape for name, (shape, _) in before.items()} == {name: shape for name, (shape, _) in after.items()}
    old, new = checkpoint_io.read_tensors(iter_dir, list(before)), checkpoint_io.read_tensors(converted, list(after))
    for name, tensor in old.items():
        rows = 8192 if name in ("embedding.word_embeddings.weight", "output_layer.weight") else tensor.shape[0]
        assert torch.equal(tensor[:rows], new[name][:rows]), name

    # Training accepts the converted checkpoint and continues exactly as from the original.
    losses = [train(1, "--train-iters", "1", "--load", str(source), "--finetune") for source in (original, back)]
    assert losses[0] == losses[1] and sorted(losses[0]) == [1]
