"""tools/benchmark/train_throughput.py on CPU: our row is the trainer (build_trainer of pretrain_difflm.py's
flags, its train_step), both rows, the FLOPs it reports, the baseline's bidirectional attention and LLaDA
loss, the fp8/compile seams, the MoE preset (grouped GEMM, per-expert loop, transformers' OLMoE and its
router loss) and bad flag combinations. No speed is asserted."""

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.flops import training_flops_per_iteration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "benchmark"))
import train_throughput as tt  # noqa: E402

TINY = ["--model", "tiny", "--steps", "2", "--warmup", "1"]
MOE_TINY = ["--model", "olmoe-tiny", "--steps", "2", "--warmup", "1"]
CPU = torch.device("cpu")


@contextlib.contextmanager
def our_arm(argv):
    """Our row of `argv` built (the trainer, in the benchmark's one-process group), closed afterwards."""
    args = tt.build_parser().parse_args(argv)
    spec = tt.validate(args)
    with tt.one_process(CPU) as runtime:
        arm = tt.build_ours(spec, args, CPU, runtime)
        try:
            yield arm
        finally:
            arm.close()


def expected_flops(config: dict, mode: str, block_size=None, output_positions=None) -> float:
    """The project's formula for the shape the JSON says was run, built here independently
    (`block_size`: block diffusion's count, a 2L-token forward; `output_positions`: where the output
    layer runs, per sequence, default every position)."""
    transformer = TransformerConfig(
        num_layers=config["num_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], num_query_groups=config["num_query_groups"],
        kv_channels=config["kv_channels"], ffn_hidden_size=config["ffn_hidden_size"],
        vocab_size=config["vocab_size"], gated_linear_unit=True)
    mask_type = "block_diffusion" if block_size else ("no_mask" if mode == "dlm" else "causal")
    return training_flops_per_iteration(transformer, config["seq_length"], config["micro_batch_size"],
                                        mask_type=mask_type, block_size=block_size, output_positions=output_positions)


def masked_positions(seq_length: int) -> float:
    """E[masked] of a row under the benchmark's objective: p = (1 - eps) t + eps, t uniform on [0, 1)."""
    return seq_length * ((1 - tt.DLM_EPS) / 2 + tt.DLM_EPS)


def check_result(result: dict, mode: str) -> None:
    assert [row["name"] for row in result["rows"]] == ["MegaDLMs", "HF transformers"]
    accumulation = result["config"]["accumulation"]
    assert result["flops_per_step"] == pytest.approx(accumulation * expected_flops(result["config"], mode), rel=1e-12)
    tokens = result["config"]["micro_batch_size"] * accumulation * result["config"]["seq_length"]
    assert result["tokens_per_step"] == tokens
    for row in result["rows"]:
        assert len(row["step_ms"]) == result["config"]["steps"]
        for key in ("median_step_ms", "tokens_per_sec_per_gpu", "tflops_per_gpu", "parameters"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key, row[key])
        assert math.isfinite(row["final_loss"]) and row["final_loss"] > 0
        seconds = row["median_step_ms"] / 1e3
        assert row["tokens_per_sec_per_gpu"] == pytest.approx(tokens / seconds)
        assert row["tflops_per_gpu"] == pytest.approx(result["flops_per_step"] / seconds / 1e12)
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # CPU: no peak, no CUDA memory
    ours, baseline = result["rows"]
    assert ours["parameters"] == baseline["parameters"]  # the same shape in both implementations
    for key in ("tokens_per_sec_per_gpu", "tflops_per_gpu"):
        assert result["ratio"][key] == pytest.approx(ours[key] / baseline[key], rel=1e-12)
    assert result["torch_version"] == torch.__version__ and result["device"] == "cpu"


def test_cli_dlm_with_hf_baseline_writes_json(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, "tools/benchmark/train_throughput.py", *TINY, "--mode", "dlm",
                           "--baseline", "hf", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "| MegaDLMs |" in proc.stdout and "| HF transformers |" in proc.stdout and "ours / baseline" in proc.stdout
    result = json.loads(out.read_text())
    check_result(result, "dlm")
    assert result["attention_mask_type"] == "no_mask"
    assert result["rows"][1]["attention"] != "causal"


def test_ar_in_process_and_dlm_counts_more_flops(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "y.json"
    result = tt.main([*TINY, "--mode", "ar", "--baseline", "hf", "--json", str(out)])
    check_result(json.loads(out.read_text()), "ar")
    assert result["rows"][1]["attention"] == "causal"
    dlm_flops = expected_flops(result["config"], "dlm")
    assert dlm_flops > result["flops_per_step"]  # bidirectional counts s keys, causal s/2


def test_accumulation_runs_its_micro_batches_before_one_optimizer_step(tmp_path, monkeypatch):
    """--accumulation 2: both rows run two micro-batches of --micro-batch-size a step, then one optimizer
    step, and count twice the tokens and FLOPs."""
    pytest.importorskip("transformers")
    shapes, optimizer_steps = [], []
    forward, adamw_step = GPTModel.forward, torch.optim.AdamW.step
    monkeypatch.setattr(GPTModel, "forward", lambda self, tokens, *a, **kw: shapes.append(tuple(tokens.shape))
                        or forward(self, tokens, *a, **kw))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **kw: optimizer_steps.append(1)
                        or adamw_step(self, *a, **kw))
    out = tmp_path / "a.json"
    tt.main([*TINY, "--mode", "ar", "--baseline", "hf", "--accumulation", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    check_result(result, "ar")
    micro = (result["config"]["micro_batch_size"], result["config"]["seq_length"])
    assert shapes == [micro] * 2 * 3  # 1 warm-up and 2 timed steps of ours, two micro-batches each
    assert len(optimizer_steps) == 2 * 3  # one a step, in each row


def test_block_diffusion_times_the_bd3_step_and_counts_its_flops(monkeypatch):
    """--block-diffusion B: the step runs [x_t ; x_0] (2L tokens) and is counted as such, with tokens/s
    over the L tokens of x_0."""
    from megatron.core.models.difflm import block_diffusion

    doubled = []
    real = block_diffusion.model_inputs

    def recording(*args):
        out = real(*args)
        doubled.append((tuple(args[0].shape), tuple(out[0].shape)))
        return out

    monkeypatch.setattr(block_diffusion, "model_inputs", recording)
    result = tt.main([*TINY, "--seq-length", "64", "--block-diffusion", "16", "--masked-only-loss"])
    row, config = result["rows"][0], result["config"]
    assert result["attention_mask_type"] == "block_diffusion" and config["block_diffusion"] == 16
    assert row["name"] == "MegaDLMs masked-only block-diffusion-16"
    assert doubled and all(inner == (2, 64) and outer == (2, 128) for inner, outer in doubled)
    # masked-only: the output layer at the masked ones of the L noisy positions
    assert result["flops_per_step"] == pytest.approx(expected_flops(config, "dlm", block_size=16,
                                                                    output_positions=masked_positions(64)), rel=1e-12)
    plain = expected_flops(config, "dlm", output_positions=masked_positions(64))
    assert result["flops_per_step"] > 1.5 * plain  # the decoder runs twice the tokens
    assert result["tokens_per_step"] == 2 * 64 and math.isfinite(row["final_loss"]) and row["final_loss"] > 0
    assert row["tokens_per_sec_per_gpu"] == pytest.approx(2 * 64 / (row["median_step_ms"] / 1e3))


def tiny_hf(family: str):
    spec = tt.MODELS["olmoe-tiny" if family == "olmoe" else "tiny"]
    if family == "llama":
        spec = tt.ModelSpec("llama", 2, 64, 4, 2, 16, 192, 1024, True, 10000.0, 256)
    torch.manual_seed(0)
    return tt.hf_model(spec), spec


def first_position_logits(model, tokens, forward_kwargs) -> torch.Tensor:
    return model(input_ids=tokens, **forward_kwargs(tokens)).logits[:, 0].detach()


@pytest.mark.parametrize("family", ["qwen3", "llama", "olmoe"])
def test_hf_baseline_attention_is_bidirectional(family):
    pytest.importorskip("transformers")
    model, spec = tiny_hf(family)
    tokens = torch.randint(0, spec.vocab_size - 1, (2, 12), generator=torch.Generator().manual_seed(3))
    later_changed = tokens.clone()
    later_changed[:, -1] = (later_changed[:, -1] + 7) % (spec.vocab_size - 1)
    # As built, the model is causal: position 0 cannot see the last token (up to rounding: an MoE's
    # experts see other groups of tokens, so its GEMMs may round differently).
    plain = lambda t: {}  # noqa: E731
    torch.testing.assert_close(first_position_logits(model, tokens, plain),
                               first_position_logits(model, later_changed, plain), rtol=0, atol=1e-6)
    forward_kwargs, how = tt.make_bidirectional(model, spec.vocab_size)
    model.train()  # the timed steps run in training mode
    before = first_position_logits(model, tokens, forward_kwargs)
    after = first_position_logits(model, later_changed, forward_kwargs)
    assert (before - after).abs().max() > 1e-4, how


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits depend only on the input ids (enough to check the loss)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids):
        return type("Output", (), {"logits": self.table[input_ids]})()


def test_llada_loss_weights_masked_tokens_by_inverse_p_over_all_tokens():
    vocab, batch, seq, mask_id = 16, 3, 10, 15
    model = FixedLogits(vocab)
    tokens = torch.randint(0, mask_id, (batch, seq), generator=torch.Generator().manual_seed(1))
    loss = tt.llada_loss(model, tokens, {}, mask_id, torch.Generator().manual_seed(5))
    # The same draws, in the same order, by hand.
    generator = torch.Generator().manual_seed(5)
    p = (1 - tt.DLM_EPS) * torch.rand(batch, 1, generator=generator) + tt.DLM_EPS
    masked = torch.rand(batch, seq, generator=generator) < p
    total = 0.0
    for row in range(batch):
        noisy = torch.where(masked[row], mask_id, tokens[row])
        for position in range(seq):
            if masked[row, position]:
                log_probs = torch.log_softmax(model.table[noisy[position]].detach(), dim=-1)
                total += -float(log_probs[tokens[row, position]]) / float(p[row])
    assert masked.any() and not masked.all()
    assert float(loss.detach()) == pytest.approx(total / (batch * seq), rel=1e-5)


@pytest.mark.parametrize("name", list(tt.MODELS))
def test_named_shapes_have_the_same_parameters_in_both_implementations(name):
    pytest.importorskip("transformers")
    spec = tt.MODELS[name]
    args = tt.build_parser().parse_args(["--model", name])
    tt.validate(args)
    trained = tt.training_args(spec, args, CPU)  # the trainer's parse of our row's flags
    assert trained.padded_vocab_size == spec.vocab_size and trained.mask_token == tt.mask_token_id(spec)
    with torch.device("meta"):  # shapes only: no memory, no init
        ours = GPTModel(trained.transformer_config, trained.dlm_config)
        baseline = tt.hf_model(spec)
    ours_count, baseline_count = (sum(p.numel() for p in model.parameters()) for model in (ours, baseline))
    # OLMoE's QK-norm weights span the whole projection, ours one head (moe_models.py): (a + g - 2) d a layer.
    qk_norm = (spec.num_attention_heads + spec.num_query_groups - 2) * spec.kv_channels if spec.moe else 0
    assert ours_count + spec.num_layers * qk_norm == baseline_count
    if name == "olmoe-1b-7b":
        assert baseline_count == 6_919_161_856  # allenai/OLMoE-1B-7B-0924


def test_fp8_prints_our_bf16_and_fp8_rows_next_to_the_baseline():
    """--fp8: a second row of ours whose decoder linears train in float8 (bf16 compute; eager on a CPU)."""
    result = tt.main([*TINY, "--mode", "dlm", "--fp8", "--baseline", "hf"])
    ours, fp8, baseline = result["rows"]
    assert ours["fp8_linears"] == 0 and fp8["precision"] == "fp8"
    assert fp8["fp8_linears"] == 4 * tt.MODELS["tiny"].num_layers
    assert math.isfinite(fp8["final_loss"]) and baseline["name"] == "HF transformers"
    assert result["fp8_ratio"]["over_ours"] == pytest.approx(
        fp8["tokens_per_sec_per_gpu"] / ours["tokens_per_sec_per_gpu"], rel=1e-12)
    assert result["ratio"]["tokens_per_sec_per_gpu"] == pytest.approx(
        ours["tokens_per_sec_per_gpu"] / baseline["tokens_per_sec_per_gpu"], rel=1e-12)


def test_torch_compile_reaches_the_trainers_layers():
    """--torch-compile is the trainer's: build_trainer compiles every layer in place (names kept)."""
    with our_arm(TINY) as plain:
        names = list(plain.model.state_dict())
    with our_arm([*TINY, "--torch-compile"]) as arm:
        layers = list(arm.model.decoder.layers.values())
        assert arm.info["compiled_layers"] == len(layers) == tt.MODELS["tiny"].num_layers
        assert all(layer._compiled_call_impl is not None for layer in layers)
        assert list(arm.model.state_dict()) == names


def test_gradient_fusion_flag_reaches_our_model():
    """--no-gradient-accumulation-fusion reaches the config (its linear layers then take plain autocast's path)."""
    with our_arm([*TINY, "--no-gradient-accumulation-fusion"]) as arm:
        assert not arm.model.config.gradient_accumulation_fusion
        assert not arm.model.decoder.layers["0"].mlp.linear_fc1.gemm.fp32_weight_grad
    with our_arm(TINY) as arm:
        assert arm.model.decoder.layers["0"].mlp.linear_fc1.gemm.fp32_weight_grad


def test_swiglu_fusion_and_moment_dtype_flags_reach_our_model():
    with our_arm([*TINY, "--no-bias-swiglu-fusion", "--exp-avg-sq-dtype", "bf16"]) as arm:
        model, optimizer = arm.model, arm.optimizer
    assert not model.config.bias_swiglu_fusion
    assert optimizer.moment_dtypes == {"exp_avg": torch.float32, "exp_avg_sq": torch.bfloat16}


def test_masked_only_loss_and_profile_flags_on_cpu(tmp_path):
    result = tt.main([*TINY, "--mode", "dlm", "--masked-only-loss", "--profile", str(tmp_path), "--profile-top", "2"])
    row = result["rows"][0]
    assert row["name"] == "MegaDLMs masked-only" and row["masked_only_loss"] and result["config"]["masked_only_loss"]
    seq = result["config"]["seq_length"]
    assert result["flops_per_step"] == pytest.approx(expected_flops(result["config"], "dlm",
                                                                    output_positions=masked_positions(seq)), rel=1e-12)
    assert result["flops_per_step"] < expected_flops(result["config"], "dlm")
    profile = row["profile"]
    assert profile["steps"] == tt.PROFILED_STEPS and profile["time"].startswith("CPU")
    assert set(profile["ms_per_step"]) == set(tt.kernel_breakdown.CATEGORIES)
    assert sum(profile["ms_per_step"].values()) == pytest.approx(profile["total_ms_per_step"])
    for category in ("attention", "gemm", "loss", "optimizer"):  # each is found in a real step
        assert profile["ms_per_step"][category] > 0, category
        top = [milliseconds for _, milliseconds in profile["top"][category]]  # the longest ops, listed
        assert top and top == sorted(top, reverse=True) and sum(top) <= profile["ms_per_step"][category] * (1 + 1e-9)
        assert len(top) <= 2  # --profile-top
    assert os.path.getsize(profile["trace"]) > 0


def test_under_masked_only_loss_each_row_counts_the_output_layer_it_runs():
    """Ours at the masked positions, Hugging Face's step at every position (its logits are all taken)."""
    result = tt.main([*TINY, "--mode", "dlm", "--masked-only-loss", "--baseline", "hf"])
    config, (ours, hf) = result["config"], result["rows"]
    assert result["hf_flops_per_step"] == pytest.approx(expected_flops(config, "dlm"), rel=1e-12)
    assert result["flops_per_step"] == pytest.approx(
        expected_flops(config, "dlm", output_positions=masked_positions(config["seq_length"])), rel=1e-12)
    for row, counted in ((ours, result["flops_per_step"]), (hf, result["hf_flops_per_step"])):
        assert row["tflops_per_gpu"] == pytest.approx(counted / (row["median_step_ms"] / 1e3) / 1e12)


@pytest.mark.parametrize("kernel, callers, category", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", ["aten::_cudnn_attention"],
     "attention"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN", ["aten::mm", "_LinearCrossEntropy"], "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ["aten::addmm", "aten::linear"], "gemm"),
    ("void at::native::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>",
     ["aten::_log_softmax", "aten::log_softmax"], "loss"),
    ("void at::native::vectorized_elementwise_kernel<4, exp_kernel_cuda>", ["aten::exp_", "_LinearCrossEntropy"],
     "loss"),
    ("void at::native::vectorized_elementwise_kernel<4, mul>",
     ["aten::mul_", "autograd::engine::evaluate_function: _VocabParallelCrossEntropyBackward"], "loss"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", ["aten::_fused_adamw_"], "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, add>", ["aten::add", "aten::silu"], "other"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6",
     ["aten::_grouped_mm", "GroupedMmBackward0"], "grouped_gemm"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8", ["aten::mm", "aten::_grouped_mm"],
     "grouped_gemm"),  # torch's fp32 fallback of grouped_mm: a loop of GEMMs
    ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NTT", ["aten::mm", "aten::linear", "moe_layer"], "gemm"),
    ("void at::native::indexFuncLargeIndex<float, long, unsigned int, 2, 2, -2, true>",
     ["aten::index_add", "moe_layer"], "moe"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>",
     ["aten::add_", "autograd::engine::evaluate_function: SelectBackward0", "moe_layer_backward"], "moe"),
])
def test_kernels_are_grouped_by_name_then_by_the_ops_that_launched_them(kernel, callers, category):
    assert tt.kernel_breakdown.classify(kernel, callers) == category


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-9"], "unknown --model 'gpt-9'; choose one of qwen3-1.7b"),
    (["--model", "tiny", "--seq-length", "512"], "--seq-length 512 is outside [1, 256]"),
    (["--model", "qwen3-1.7b", "--seq-length", "65536"], "--seq-length 65536 is outside [1, 40960]"),
    (["--model", "tiny", "--steps", "0"], "--steps 0 must be at least 1"),
    (["--model", "tiny", "--attention-backend", "cudnn"], "--attention-backend 'cudnn' is not one of"),
    (["--model", "tiny", "--compile-loss"], "--compile-loss needs --masked-only-loss"),
    (["--model", "tiny", "--loss-chunk-size", "0"], "--loss-chunk-size 0 must be at least 1"),
    (["--model", "tiny", "--num-layers", "0"], "--num-layers 0 must be at least 1"),
    (["--model", "tiny", "--profile-top", "0"], "--profile-top 0 must be at least 1"),
    (["--model", "tiny", "--mode", "ar", "--block-diffusion", "16"], "--block-diffusion needs --mode dlm"),
    (["--model", "tiny", "--block-diffusion", "48"], "--block-diffusion 48 must be a positive divisor of"),
    (["--model", "tiny", "--block-diffusion", "16", "--baseline", "hf"], "--block-diffusion has no Hugging Face"),
    (["--model", "tiny", "--compare-grouped-gemm"], "--compare-grouped-gemm needs an MoE --model"),
    (["--model", "olmoe-tiny", "--compare-grouped-gemm", "--no-moe-grouped-gemm"],
     "--compare-grouped-gemm times both our variants"),
    (["--model", "olmoe-tiny", "--hf-experts-implementation", "eager"],
     "--hf-experts-implementation needs --baseline hf"),
])
def test_bad_flags_give_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tt.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("module, flag, message", [
    ("transformers", ["--baseline", "hf"], "--baseline hf needs the transformers package: pip install transformers"),
])
def test_missing_optional_package_is_named(module, flag, message, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(SystemExit) as exit_info:
        tt.main(["--model", "tiny", *flag])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"train_throughput.py: error: {message}"


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_reaches_our_model_and_leaves_the_losses_unchanged(recompute):
    with our_arm([*TINY, "--recompute", recompute]) as arm:
        assert arm.model.config.recompute_granularity == recompute
    plain = tt.main([*TINY, "--mode", "dlm"])["rows"][0]
    result = tt.main([*TINY, "--mode", "dlm", "--recompute", recompute])
    row = result["rows"][0]
    assert row["name"] == f"MegaDLMs recompute-{recompute}" and result["config"]["recompute"] == recompute
    assert row["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-6)  # the same math, replayed


@pytest.mark.parametrize("mode", ["dlm", "ar"])
def test_our_step_is_the_train_step_of_the_trainer_build_trainer_builds(mode, monkeypatch):
    """Our row builds one Trainer through build_trainer and each of its steps is that trainer's train_step
    (1 warm-up, 2 timed); its final loss is the third iteration's loss of pretrain_difflm.py trained by
    Trainer.train() from the flags the row records."""
    import pretrain_difflm
    from custom_args.difflm import add_difflm_args
    from megatron.training.run_config import parse_run_config
    from megatron.training.training import Trainer, build_trainer

    built, stepped, train_step = [], [], Trainer.train_step
    monkeypatch.setattr(tt, "build_trainer", lambda *a, **k: built.append(build_trainer(*a, **k)) or built[-1])
    monkeypatch.setattr(Trainer, "train_step", lambda self, data: stepped.append(self) or train_step(self, data))
    row = tt.main([*TINY, "--mode", mode])["rows"][0]
    assert len(built) == 1 and stepped == [built[0]] * 3 and built[0].state.iteration == 3
    assert math.isfinite(row["final_loss"]) and row["final_loss"] > 0
    monkeypatch.undo()
    flags = row["pretrain_difflm_flags"].split()
    assert "--mock-data" in flags and ("vanilla" in flags) == (mode == "ar")
    with tt.one_process(CPU) as runtime:
        trainer = build_trainer(parse_run_config(flags, add_difflm_args, world_size=1), runtime,
                                pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                                pretrain_difflm.forward_step)
        trainer.train()
        trainer.logger.close()
    assert len(trainer.history) == 3
    assert row["final_loss"] == pytest.approx(trainer.history[-1].loss, rel=1e-6)


def test_the_qwen3_shape_and_objective_are_the_launch_scripts(tmp_path):
    """qwen3-1.7b in DLM mode with the 1.7B script's levers builds the model config and objective of
    examples/dlm_training/dlm_pretrain_1.7b.sh (but the vocabulary padding and the varying length)."""
    import dataclasses

    from custom_args.difflm import add_difflm_args
    from megatron.training.arguments import parse_args
    from tests.launch_flags import recorded_flags

    script = parse_args(recorded_flags("examples/dlm_training/dlm_pretrain_1.7b.sh", tmp_path,
                                       {"GPUS_PER_NODE": "1", "TENSORBOARD_DIR": str(tmp_path / "tb")}),
                        add_difflm_args, world_size=1)
    args = tt.build_parser().parse_args(["--model", "qwen3-1.7b", "--masked-only-loss", "--compile-loss",
                                         "--torch-compile", "--compile-optimizer-step", "--cache-low-precision-weights",
                                         "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--device", "cuda"])
    ours = tt.training_args(tt.validate(args), args, torch.device("cuda"))  # CUDA: --bf16, as the script
    vocabulary = {"vocab_size": 0, "unpadded_vocab_size": 0}
    assert dataclasses.replace(ours.transformer_config, **vocabulary) == dataclasses.replace(
        script.transformer_config, **vocabulary)
    assert dataclasses.replace(ours.dlm_config, mask_token_id=0) == dataclasses.replace(
        script.dlm_config, mask_token_id=0, varilen_prob=0.0)
    for flag in ("torch_compile", "compile_optimizer_step", "cache_low_precision_weights", "exp_avg_dtype",
                 "exp_avg_sq_dtype", "lr", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad", "seed"):
        assert getattr(ours, flag) == getattr(script, flag), flag


# ---------------------------------------------------------------------- the MoE preset
def expected_moe_flops(config: dict, mode: str) -> float:
    """OLMoE's matmuls by hand: per token and layer the attention of the dense count, the router
    (2 h E) and the top-k SwiGLU experts (gate, up, down: k x 3 x 2 h F), once the output layer;
    3 x forward for training."""
    h, a, g, d = (config[key] for key in ("hidden_size", "num_attention_heads", "num_query_groups", "kv_channels"))
    moe, seq = config["moe"], config["seq_length"]
    keys = seq if mode == "dlm" else seq / 2
    layer = (2 * h * (a + 2 * g) * d + 2 * 2 * a * d * keys + 2 * a * d * h + 2 * h * moe["num_experts"]
             + moe["topk"] * 3 * 2 * h * moe["expert_ffn_hidden_size"])
    per_token = config["num_layers"] * layer + 2 * h * config["vocab_size"]
    return 3 * per_token * seq * config["micro_batch_size"]


def test_moe_preset_times_grouped_gemm_per_expert_loop_and_hf_olmoe(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "moe.json"
    result = tt.main([*MOE_TINY, "--mode", "dlm", "--num-layers", "1", "--baseline", "hf", "--compare-grouped-gemm",
                      "--json", str(out)])
    names = ["MegaDLMs grouped-gemm", "MegaDLMs per-expert-loop", "HF transformers"]
    assert [row["name"] for row in json.loads(out.read_text())["rows"]] == names
    printed = capsys.readouterr().out
    assert all(f"| {name} |" in printed for name in names)
    assert "ours / baseline" in printed and "grouped GEMM / per-expert loop" in printed
    config = result["config"]
    assert config["num_layers"] == 1 and result["transformer_config"]["moe"]["layer_flags"] == [1]
    assert result["flops_per_step"] == pytest.approx(expected_moe_flops(config, "dlm"), rel=1e-12)
    assert result["flops_per_step"] > expected_flops(config, "dlm")  # top-2 experts and a router over one MLP
    grouped, loop, baseline = result["rows"]
    seconds = {row["name"]: row["median_step_ms"] / 1e3 for row in result["rows"]}
    for row in result["rows"]:
        assert len(row["step_ms"]) == config["steps"] and math.isfinite(row["final_loss"])
        assert row["tflops_per_gpu"] == pytest.approx(result["flops_per_step"] / seconds[row["name"]] / 1e12)
    assert (grouped["moe_grouped_gemm"], loop["moe_grouped_gemm"]) == (True, False)
    assert not grouped["grouped_mm_kernel"]  # torch grouped_mm needs CUDA and bf16: the same math here
    assert grouped["final_loss"] == pytest.approx(loop["final_loss"], rel=1e-5)
    assert baseline["attention"] != "causal" and baseline["experts_implementation"]  # passed leaks_future
    spec = tt.MODELS["olmoe-tiny"]
    qk_norm = (spec.num_attention_heads + spec.num_query_groups - 2) * spec.kv_channels
    assert grouped["parameters"] == loop["parameters"] == baseline["parameters"] - qk_norm  # one layer in both
    for key in ("tokens_per_sec_per_gpu", "tflops_per_gpu"):
        assert result["ratio"][key] == pytest.approx(grouped[key] / baseline[key], rel=1e-12)
        assert result["grouped_gemm_ratio"][key] == pytest.approx(grouped[key] / loop[key], rel=1e-12)


def test_moe_preset_in_ar_mode_is_causal_with_one_expert_path():
    pytest.importorskip("transformers")
    result = tt.main([*MOE_TINY, "--mode", "ar", "--baseline", "hf", "--no-moe-grouped-gemm"])
    assert [row["name"] for row in result["rows"]] == ["MegaDLMs per-expert-loop", "HF transformers"]
    assert result["rows"][1]["attention"] == "causal" and result["grouped_gemm_ratio"] is None
    assert result["flops_per_step"] == pytest.approx(expected_moe_flops(result["config"], "ar"), rel=1e-12)


def test_hf_router_loss_is_the_term_olmoe_adds_when_given_labels():
    pytest.importorskip("transformers")
    spec = tt.MODELS["olmoe-tiny"]
    torch.manual_seed(0)
    model = tt.hf_model(spec).eval()
    tokens = torch.randint(0, spec.vocab_size - 1, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_router = model(input_ids=tokens, labels=tokens)
        without = model(input_ids=tokens, labels=tokens, output_router_logits=False)
    aux = float(tt.moe_models.router_aux_loss(model)(with_router))
    assert aux > 0 and float(with_router.loss - without.loss) == pytest.approx(aux, abs=1e-5)
    copy = tt.moe_models.switch_loss(with_router.router_logits, spec.moe.num_experts, spec.moe.topk)
    assert float(copy) * model.config.router_aux_loss_coef == pytest.approx(aux, rel=1e-5)


def test_llada_loss_adds_the_aux_loss_of_the_outputs():
    vocab, mask_id = 16, 15
    model = FixedLogits(vocab)
    tokens = torch.randint(0, mask_id, (3, 10), generator=torch.Generator().manual_seed(1))
    plain = tt.llada_loss(model, tokens, {}, mask_id, torch.Generator().manual_seed(5))
    seen = []
    with_aux = tt.llada_loss(model, tokens, {}, mask_id, torch.Generator().manual_seed(5),
                             aux_loss=lambda outputs: seen.append(outputs) or torch.tensor(0.25))
    assert float(with_aux.detach()) == pytest.approx(float(plain.detach()) + 0.25)
    assert seen[0].logits.shape == (3, 10, vocab)


def test_moe_scopes_bracket_forward_and_backward_of_every_moe_layer():
    spec = tt.MODELS["olmoe-tiny"]
    breakdown = tt.kernel_breakdown
    with our_arm(MOE_TINY) as arm, torch.profiler.profile() as profiler, breakdown.moe_scopes(arm.model) as layers:
        model = arm.model
        arm.step(0)
    events = profiler.events()
    names = [event.name for event in events]
    assert layers == spec.num_layers == names.count("moe_layer") == names.count("moe_layer_backward")
    combine_backward = [event for event in events if event.name.endswith("BmmBackward0")]  # the combine
    assert combine_backward and all(breakdown.classify(event.name, breakdown.callers(event.cpu_parent)) == "moe"
                                    for event in combine_backward)
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    dense = GPTModel(tt.transformer_config(tt.MODELS["tiny"], CPU), DLMConfig(model_running_mode="vanilla"))
    with breakdown.moe_scopes(dense) as dense_layers:
        assert dense_layers == 0


def test_profile_of_the_moe_preset_has_its_moe_time(tmp_path):
    pytest.importorskip("transformers")
    result = tt.main([*MOE_TINY, "--steps", "1", "--num-layers", "1", "--baseline", "hf", "--profile", str(tmp_path)])
    for row in result["rows"]:
        profile = row["profile"]
        assert set(profile["ms_per_step"]) == set(tt.kernel_breakdown.CATEGORIES)
        assert profile["ms_per_step"]["moe"] > 0 and profile["top"]["moe"], row["name"]
        assert profile["ms_per_step"]["gemm"] + profile["ms_per_step"]["grouped_gemm"] > 0, row["name"]
