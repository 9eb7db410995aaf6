"""The launch scripts users bring run unchanged: MegaDLMs' flagship 1.7B DLM script and Megatron-LM's
GPT-3 175B, Llama-3 8B and Mixtral 8x7B example scripts, each with every flag it passes.

Only the shape (tiny), the parallel sizes (one process), the iteration counts and the paths are
changed; the flags and their other values are the scripts' own. Megatron's scripts start
`pretrain_gpt.py` (autoregressive); MegaDLMs' starts `pretrain_difflm.py`. Each run trains a
few steps in this process with no flag rejected.
"""

import gc
import json
import sys
import types
from pathlib import Path

import pytest

import pretrain_difflm
import pretrain_gpt
from tests.unit_tests.test_bad_inputs_training import write_corpus
from tests.unit_tests.test_tokenizers import save_gpt2, save_hf

ROOT = Path(__file__).resolve().parents[2]
TINY_SHAPE = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "128"}


def megadlms_1p7b(d: dict) -> list:
    """examples/dlm_training/dlm_pretrain_1.7b.sh of MegaDLMs: its 83 training flags, in its order."""
    ckpt = d["ckpt"]
    return [
        # GPT_MODEL_ARGS
        "--seq-length", "32", "--attention-backend", "flash", "--attention-softmax-in-fp32",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-bias-swiglu-fusion", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--swiglu", "--vocab-size", str(d["hf_vocab"]), "--normalization", "RMSNorm",
        "--max-position-embeddings", "32", "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--qk-layernorm", "--untie-embeddings-and-output-weights",
        # PLMT_ARGS
        "--model-running-mode", "difflm-noshift", "--base-model", "vanilla", "--mask-token", str(d["hf_mask"]),
        "--attention-mask-type", "no_mask",
        # TRAINING_ARGS
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.02", "--clip-grad", "1.0", "--bf16",
        "--lr", "0.0002", "--min-lr", "0.00002", "--lr-decay-style", "WSD", "--lr-warmup-iters", "1",
        "--lr-decay-iters", "4", "--lr-wsd-decay-style", "exponential", "--lr-wsd-decay-iters", "2",
        "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "1", "--rerun-mode", "validate_results",
        "--overlap-param-gather", "--overlap-grad-reduce", "--distributed-timeout-minutes", "60",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        # DATA_ARGS
        "--train-data-path", d["corpus"], "--valid-data-path", d["corpus"], "--data-cache-path", d["cache"],
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", d["hf"],
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput", "--log-progress",
        "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
        "--save-interval", "2", "--non-persistent-save-interval", "8", "--non-persistent-ckpt-type", "global",
        "--non-persistent-global-ckpt-dir", f"{ckpt}/non_persistent", "--ckpt-format", "torch_dist",
        "--auto-detect-ckpt-format", "--ckpt-fully-parallel-load", "--eval-interval", "2", "--save", ckpt,
        "--load", ckpt, "--eval-iters", "1", "--tensorboard-dir", d["tb"], "--wandb-project", "dlm",
        "--wandb-exp-name", "dlm_training", "--wandb-run-id", "dlm_training", "--wandb-save-dir", d["wandb"],
        "--wandb-mode", "offline", "--wandb-tags", "dlm", "--wandb-notes", "training", "--wandb-resume", "allow",
    ]


def gpt3_175b(d: dict) -> list:
    """Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--rampup-batch-size", "2", "2", "8",
        "--train-iters", "4", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "4",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--data-path", d["corpus"], "--vocab-file", d["gpt2"][0], "--merge-file", d["gpt2"][1], "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "2", "--eval-interval", "2", "--save", d["ckpt"], "--load", d["ckpt"],
        "--eval-iters", "1", "--tensorboard-dir", d["tb"],
    ]


def llama3_8b(d: dict) -> list:
    """Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh with its mock-data branch (DTYPE=bf16 drops
    --fp8-format: fp8 needs a GPU; its other fp8 knobs stay)."""
    return [
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "16", "--lr-decay-samples", "12",
        "--lr-warmup-samples", "4", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
        "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--data-cache-path", d["cache"],
        "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "2", "--save-interval", "2", "--log-throughput",
        "--profile", "--profile-step-start", "1", "--profile-step-end", "2", "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60", "--save", d["ckpt"], "--load", d["ckpt"], "--tensorboard-dir", d["tb"],
    ]


def mixtral_8x7b(d: dict) -> list:
    """Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh."""
    return [
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings", "64",
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
        "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
        "--group-query-attention", "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
        "--rotary-base", "1000000",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", d["spm"], "--data-path", d["corpus"],
        "--split", "99990,8,2",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "4",
        "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "1",
        "--use-distributed-optimizer", "--sequence-parallel",
        "--log-interval", "1", "--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1", "--save", d["ckpt"],
        "--load", d["ckpt"], "--tensorboard-dir", f"{d['ckpt']}/tensorboard", "--no-load-optim", "--no-load-rng",
        "--wandb-project", "Mixtral", "--wandb-exp-name", "Mixtral_8x7B",
    ]


SCRIPTS = {"megadlms_dlm_pretrain_1.7b": (megadlms_1p7b, pretrain_difflm),
           "megatron_gpt3_175b": (gpt3_175b, pretrain_gpt),
           "megatron_llama3_8b": (llama3_8b, pretrain_gpt),
           "megatron_mixtral_8x7b": (mixtral_8x7b, pretrain_gpt)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("script_files")
    hf = save_hf(root / "hf", ("<|endoftext|>", "<|mdm_mask|>"))
    tokenizer = json.loads((hf / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    return {"corpus": write_corpus(root / "corpus", num_documents=1200, length=40), "hf": str(hf),
            "hf_vocab": len(vocab) + sum(t["content"] not in vocab for t in tokenizer["added_tokens"]),
            "hf_mask": next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|mdm_mask|>"),
            "gpt2": save_gpt2(root / "gpt2"), "spm": str(ROOT / "examples/data/tokenizer/spm_8k.model")}


@pytest.fixture()
def fake_wandb(monkeypatch, tmp_path):
    """wandb is optional and not installed here: a stand-in records what the run gives it."""
    calls = []
    module = types.ModuleType("wandb")
    run = types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda *a, **k: None)
    module.init = lambda **kwargs: calls.append(kwargs) or run
    module.log = run.log
    module.finish = run.finish
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_script_trains_with_every_one_of_its_flags(name, files, fake_wandb, tmp_path, capsys):
    flags, entry = SCRIPTS[name]
    paths = dict(files, ckpt=str(tmp_path / "ckpt"), tb=str(tmp_path / "tb"), cache=str(tmp_path / "cache"),
                 wandb=str(tmp_path / "wandb"))
    try:
        trainer = entry.main(flags(paths))
    finally:
        gc.enable()  # --manual-gc turns Python's automatic collection off for the run
    err = capsys.readouterr().err
    assert "error:" not in err and "unrecognized" not in err, err
    assert trainer.state.iteration == trainer.config.train_iters
    losses = [result.loss for result in trainer.history if not result.skipped]
    assert losses and all(loss == loss for loss in losses), "at least one finite step"
    if "--wandb-project" in flags(paths):
        assert fake_wandb and fake_wandb[0]["project"] in ("dlm", "Mixtral")


def test_the_megadlms_set_is_the_whole_script():
    """The script's GPT_MODEL, PLMT, TRAINING, MODEL_PARALLEL, DATA and EVAL_AND_LOGGING arrays hold 83 flags."""
    argv = megadlms_1p7b({key: "x" for key in ("ckpt", "tb", "cache", "wandb", "corpus", "hf", "hf_vocab", "hf_mask")})
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) == 83 and len(set(flags)) == len(flags)
