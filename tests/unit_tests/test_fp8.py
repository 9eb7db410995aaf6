"""FP8 training through torchao's float8: the module swap, the formats, the flags."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.fp8.torchao_float8 import swap_parallel_linears
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from tests.distributed.test_pretrain_cli import LOSS

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(hidden=64):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=4 * hidden, vocab_size=128, qk_layernorm=True)
    return GPTModel(config, DLMConfig(mask_token_id=127))


def test_parallel_linears_swap_to_nn_linear_exactly():
    """torchao converts nn.Linear: the swapped modules share the parameters and compute the same."""
    model = tiny_model().eval()
    names = [name for name, _ in model.named_parameters()]
    tokens = torch.randint(0, 127, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(tokens)
    assert swap_parallel_linears(model.decoder) == 4 * 2  # qkv, proj, fc1, fc2 per layer
    assert sum(isinstance(m, torch.nn.Linear) for m in model.decoder.modules()) == 8
    assert [name for name, _ in model.named_parameters()] == names
    with torch.no_grad():
        assert torch.equal(model(tokens), reference)


def test_formats_choose_the_gradient_element_type():
    pytest.importorskip("torchao.float8", reason="torchao is an optional extra (installed by .[dev])")
    from megatron.core.fp8.torchao_float8 import float8_config

    assert float8_config("hybrid").cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert float8_config("e4m3").cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert float8_config("e4m3", "rowwise").cast_config_weight.target_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="choose a format from"):
        float8_config("e5m2")


def test_fp8_training_converts_the_decoder_and_trains():
    pytest.importorskip("torchao.float8", reason="torchao is an optional extra (installed by .[dev])")
    env = dict(os.environ, NPROC="1", TRAIN_ITERS="12", MOCK_DATA="1", OMP_NUM_THREADS="2",
               TENSORBOARD_DIR="/tmp/fp8-test-tb", CHECK_ARGS="0")  # the flags' check: test_launch_scripts.py
    result = subprocess.run(["bash", "examples/quickstart.sh", "--eval-iters", "0", "--fp8-format", "hybrid",
                             "--difflm-masked-only-loss", "--fp8-output-layer"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)  # ~10 s
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("> fp8: 16 linear layers train in float8 (hybrid, tensorwise); the output layer's logits and "
            "input-gradient GEMMs too (tensorwise)") in result.stdout  # 4 layers x 4
    losses = [float(loss) for _, loss in LOSS.findall(result.stdout)]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3]), losses


def test_torchao_fp8_with_tensor_parallelism_is_refused_before_any_work():
    command = [sys.executable, "pretrain_difflm.py", "--num-layers", "2", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
               "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
               "--mock-data", "--vocab-size", "128", "--add-mask-token", "--tensor-model-parallel-size", "2",
               "--fp8-format", "hybrid"]
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="2"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "--fp8-format under tensor parallelism runs in the float8 layers" in result.stderr
    assert result.stderr.strip().endswith("add --cache-low-precision-weights")  # the path that runs under TP


def test_float8_gemms_on_cpu_leave_onednn_only_for_cpu_runs():
    """oneDNN's float8 matmul is a reference loop on CPUs with AMX tiles (the quickstart's fp8 run took
    over 10 minutes there): CPU runs turn it off for torch's own kernel, CUDA runs leave it alone."""
    from megatron.core.fp8.torchao_float8 import float8_gemms_on_cpu

    enabled = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = True
        float8_gemms_on_cpu(torch.device("cuda", 0))
        assert torch.backends.mkldnn.enabled
        float8_gemms_on_cpu(torch.device("cpu"))
        assert not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available())
        a, b = torch.randn(32, 64), torch.randn(48, 64)
        one = torch.tensor(1.0)
        product = torch._scaled_mm(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t(), one, one,
                                   out_dtype=torch.float32)
        widened = a.to(torch.float8_e4m3fn).float() @ b.to(torch.float8_e4m3fn).float().t()
        torch.testing.assert_close(product, widened)
    finally:
        torch.backends.mkldnn.enabled = enabled
