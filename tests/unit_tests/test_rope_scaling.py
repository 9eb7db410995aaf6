"""RoPE scaling (Llama 3.1's, YaRN) and causal sliding windows: model, flags, checkpoints, HF conversion.

The frequencies are checked against a re-derivation written here from the definitions (Llama 3.1's
three wavelength bands; YaRN's ramp over the dimension pairs between the beta_fast / beta_slow
rotation counts, and its attention temperature), not against transformers. The conversions use
tiny random transformers models (2 layers, hidden 64, original context 16) at 48 tokens, past the
original context and past the sliding window, where an unscaled or unwindowed import would differ.
"""

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from custom_args.difflm import add_difflm_args
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.rope_scaling import inverse_frequencies
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_files import FORMAT_VERSION
from megatron.training.checkpointing import _check_compatible
from megatron.training.configs import RunRecord

VOCAB, LENGTH, TOLERANCE = 90, 48, 1e-4


def rope_config(**changes) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
    return TransformerConfig(**(base | changes)).validate()


# ------------------------------------------------------------------------------ frequencies
def reference_llama3(dim, base, factor, low, high, original):
    """Llama 3.1 (Meta's reference apply_scaling): keep short wavelengths, divide long ones by the
    factor, and between original/high and original/low mix the two by (original/wavelength - low) / (high - low)."""
    out = []
    for i in range(0, dim, 2):
        freq = base ** (-i / dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_frequencies_follow_the_three_bands():
    config = rope_config(rope_scaling_type="llama3", rope_scaling_factor=4.0, rope_scaling_low_freq_factor=1.0,
                         rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=64)
    expected = reference_llama3(16, 10000.0, 4.0, 1.0, 4.0, 64)
    plain = torch.tensor([10000.0 ** (-i / 16) for i in range(0, 16, 2)], dtype=torch.float64)
    kept, scaled = expected == plain, torch.isclose(expected, plain / 4.0)
    assert kept.any() and scaled.any() and (~kept & ~scaled).any()  # all three bands occur
    inv_freq, factor = inverse_frequencies(16, 10000.0, dataclasses.asdict(config))
    assert factor == 1.0 and torch.allclose(inv_freq, expected, rtol=1e-12, atol=0)
    table = RotaryEmbedding(config).cos_table
    assert torch.allclose(table[40, :8].double(), torch.cos(40 * expected), atol=1e-6)


def reference_yarn(dim, base, factor, original, beta_fast, beta_slow, rounded):
    """YaRN's NTK-by-parts: pair d turns original / (2 pi base^(2d/dim)) times over the original context;
    the ramp runs linearly over the pair index from where that count is beta_fast to where it is beta_slow
    (log-turns fall linearly in d), ends rounded outwards; pairs before it keep their frequency, after it
    are divided by the factor."""
    log_turns_at_0, slope = math.log(original / (2 * math.pi)), -2 * math.log(base) / dim

    def where(turns):
        return (math.log(turns) - log_turns_at_0) / slope

    start, end = where(beta_fast), where(beta_slow)
    if rounded:
        start, end = math.floor(start), math.ceil(end)
    start, end = max(start, 0), min(end, dim - 1)
    out = []
    for d in range(dim // 2):
        freq = base ** (-2 * d / dim)
        weight = min(max((d - start) / (end - start), 0.0), 1.0)  # 0: kept, 1: divided by the factor
        out.append((1 - weight) * freq + weight * freq / factor)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("rounded", [True, False])
def test_yarn_frequencies_and_attention_temperature(rounded):
    config = rope_config(kv_channels=32, rope_scaling_type="yarn", yarn_rotary_scaling_factor=4.0,
                         yarn_original_max_position_embeddings=16, yarn_beta_fast=8.0, yarn_beta_slow=0.5,
                         yarn_correction_range_round_to_int=rounded)
    expected = reference_yarn(32, 10000.0, 4.0, 16, 8.0, 0.5, rounded)
    inv_freq, factor = inverse_frequencies(32, 10000.0, dataclasses.asdict(config))
    assert torch.allclose(inv_freq, expected, rtol=1e-12, atol=0)
    plain = torch.tensor([10000.0 ** (-2 * d / 32) for d in range(16)], dtype=torch.float64)
    assert inv_freq[0] == plain[0] and torch.isclose(inv_freq[-1], plain[-1] / 4.0)
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)  # sqrt(1/t) of the paper
    table = RotaryEmbedding(config).sin_table  # the temperature scales cos and sin (q.k by its square)
    assert torch.allclose(table[30, :16].double(), factor * torch.sin(30 * expected), atol=1e-6)
    # DeepSeek's generalisation: (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1).
    _, ratio = inverse_frequencies(32, 10000.0, dataclasses.asdict(config.replace(yarn_mscale=2.0,
                                                                                  yarn_mscale_all_dim=0.5)))
    assert ratio == pytest.approx((0.2 * math.log(4.0) + 1) / (0.05 * math.log(4.0) + 1))


def test_bad_scaling_settings_name_their_field():
    for changes, field in ((dict(rope_scaling_type="ntk"), "rope_scaling_type"),
                           (dict(rope_scaling_type="llama3", rope_scaling_high_freq_factor=0.5),
                            "rope_scaling_high_freq_factor"),
                           (dict(rope_scaling_type="yarn", yarn_beta_slow=0.0), "yarn_beta_slow")):
        with pytest.raises(ValueError, match=f"TransformerConfig.{field}="):
            rope_config(**changes)


# ------------------------------------------------------------------------------ flags and checkpoints
MODEL = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--train-iters", "1", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "64", "--add-mask-token",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def test_flags_set_the_scaling_and_the_tables_follow():
    llama3 = parse_args(MODEL + ["--use-rope-scaling", "--rope-scaling-factor", "32",
                                 "--rope-scaling-original-max-position-embeddings", "16"], add_difflm_args, 1)
    yarn = parse_args(MODEL + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                               "--yarn-original-max-position-embeddings", "8", "--yarn-beta-fast", "16",
                               "--mscale", "0.5", "--no-yarn-correction-range-round-to-int"], add_difflm_args, 1)
    plain = RotaryEmbedding(parse_args(MODEL, add_difflm_args, 1).transformer_config).cos_table
    for args, kind in ((llama3, "llama3"), (yarn, "yarn")):
        config = args.transformer_config
        assert config.rope_scaling_type == kind
        inv_freq, factor = inverse_frequencies(16, 10000.0, dataclasses.asdict(config))
        table = RotaryEmbedding(config).cos_table
        assert torch.allclose(table[31, :8].double(), factor * torch.cos(31 * inv_freq), atol=1e-6)
        assert not torch.allclose(table, plain, atol=1e-3)
    assert llama3.transformer_config.rope_scaling_factor == 32.0
    assert llama3.transformer_config.rope_scaling_original_max_position_embeddings == 16
    config = yarn.transformer_config
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings, config.yarn_beta_fast,
            config.yarn_beta_slow, config.yarn_mscale, config.yarn_mscale_all_dim,
            config.yarn_correction_range_round_to_int) == (4.0, 8, 16.0, 1.0, 0.5, 0.0, False)


@pytest.mark.parametrize("extra,message", [
    (["--rope-scaling-factor", "4"], "--rope-scaling-factor has no effect without --use-rope-scaling"),
    (["--yarn-beta-fast", "4"], "--yarn-beta-fast has no effect without --position-embedding-type yarn"),
    (["--mscale", "2"], "--mscale has no effect without --position-embedding-type yarn"),
    (["--use-rope-scaling", "--position-embedding-type", "yarn"], "--use-rope-scaling has no effect without"),
    (["--rope-type", "yarn"], "--rope-type yarn selects YaRN for multi-latent attention"),
    (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0"],
     "yarn_rotary_scaling_factor=0.0 must be a finite number > 0 \\(flag --rotary-scaling-factor\\)"),
])
def test_bad_scaling_flags_exit_with_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(MODEL + extra, add_difflm_args, 1)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and re.search(message, lines[0]), lines


def test_vanilla_reads_a_sliding_window(capsys):
    args = parse_args(MODEL + ["--model-running-mode", "vanilla", "--attention-mask-type", "sliding_window",
                               "--sliding-window", "4"], add_difflm_args, 1)
    assert args.dlm_config.effective_mask_type == "sliding_window" and "no effect" not in capsys.readouterr().err
    torch.manual_seed(0)
    model = GPTModel(rope_config(sliding_window=4, attention_backend="math"), args.dlm_config).eval()
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 3] = (changed[0, 3] + 1) % VOCAB
    with torch.no_grad():
        moved = (model(tokens) - model(changed)).abs().amax(-1)[0] > 0
    assert moved.tolist() == [False] * 3 + [True] * 4 + [False] * 5  # one layer: queries 3..6 see key 3


def check(saved, run, finetune=False, saved_dlm=None, run_dlm=None):
    dlm = DLMConfig(model_running_mode="vanilla")
    metadata = {"format_version": FORMAT_VERSION, "transformer_config": dataclasses.asdict(saved),
                "dlm_config": dataclasses.asdict(saved_dlm or dlm)}
    record = RunRecord(transformer_config=run, dlm_config=run_dlm or dlm, seq_length=16, tokenizer=None)
    _check_compatible(record, finetune, metadata, "ckpt/iter_0000010")


def test_a_resume_with_other_scaling_is_refused_unless_finetuning():
    llama3 = rope_config(rope_scaling_type="llama3", rope_scaling_factor=32.0)
    yarn = rope_config(rope_scaling_type="yarn", yarn_rotary_scaling_factor=4.0)
    check(llama3, llama3)
    check(rope_config(), rope_config(rope_scaling_factor=2.0, yarn_beta_fast=3.0))  # unused settings: free
    for saved, run, flag in ((llama3, rope_config(), "--use-rope-scaling / --position-embedding-type"),
                             (llama3, llama3.replace(rope_scaling_factor=8.0), "--rope-scaling-factor"),
                             (yarn, yarn.replace(yarn_rotary_scaling_factor=2.0), "--rotary-scaling-factor"),
                             (yarn, yarn.replace(yarn_mscale_all_dim=1.0), "--mscale-all-dim")):
        with pytest.raises(ValueError, match=f"\\({flag}\\); pass the checkpoint's value, or --finetune"):
            check(saved, run)
        check(saved, run, finetune=True)
    window = DLMConfig(model_running_mode="vanilla", attention_mask_type="sliding_window")
    with pytest.raises(ValueError, match="sliding_window=8 but this run has 4 \\(--sliding-window\\)"):
        check(rope_config(sliding_window=8), rope_config(sliding_window=4), saved_dlm=window, run_dlm=window)
    with pytest.raises(ValueError, match="--attention-mask-type"):
        check(rope_config(sliding_window=8), rope_config(sliding_window=8), saved_dlm=window)


def test_use_checkpoint_args_takes_the_scaling():
    from megatron.training.checkpoint_args import checkpoint_rope_flags
    from megatron.training.rope_args import add_rope_args, rope_config_fields

    parser = argparse.ArgumentParser()
    parser.add_argument("--position-embedding-type", default="rope")
    add_rope_args(parser)
    for saved in (rope_config(rope_scaling_type="llama3", rope_scaling_factor=32.0, rope_scaling_low_freq_factor=2.0,
                              rope_scaling_original_max_position_embeddings=16),
                  rope_config(rope_scaling_type="yarn", yarn_rotary_scaling_factor=4.0, yarn_mscale=0.7,
                              yarn_original_max_position_embeddings=16, yarn_correction_range_round_to_int=False)):
        args = parser.parse_args([])
        checkpoint_rope_flags(args, dataclasses.asdict(saved))
        rebuilt = rope_config(**rope_config_fields(args))
        check(saved, rebuilt)


# ------------------------------------------------------------------------------ Hugging Face
def tiny_hf(kind: str, path: Path):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if kind == "llama3":  # Llama-3.2-style, original context 16
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=16, rope_parameters=rope, **common))
    elif kind == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": 8.0, "mscale": 2.0, "mscale_all_dim": 1.0}
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, rope_parameters=rope, **common))
    else:  # a window of 8 in every layer
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(use_sliding_window=True, sliding_window=8,
                                                                       max_window_layers=0, **common))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    model.eval().save_pretrained(str(path))
    return model


def hf_ids():
    return torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["llama3", "yarn", "sliding_window"])
def test_import_verify_and_export_past_the_original_context(kind, tmp_path, capsys):
    import transformers

    from tools.weights_conversion import checkpoint_io, hf_to_megatron, megatron_to_hf, verify_correctness_dlm

    torch.manual_seed(0)
    original = tiny_hf(kind, tmp_path / "hf")
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    ours, metadata, _ = checkpoint_io.load_model(str(tmp_path / "ckpt"))
    saved = metadata["transformer_config"]
    assert saved["rope_scaling_type"] == {"llama3": "llama3", "yarn": "yarn"}.get(kind, "none")
    assert saved["sliding_window"] == (8 if kind == "sliding_window" else None)
    tokens = hf_ids()
    with torch.no_grad():
        reference = original(tokens).logits
        assert (ours(tokens)[..., :VOCAB] - reference).abs().max() <= TOLERANCE
        # Without the scaling (or the window) the import would be wrong at these positions.
        plain = GPTModel(ours.config.replace(rope_scaling_type="none", sliding_window=None),
                         DLMConfig(model_running_mode="vanilla")).eval()
        plain.load_state_dict(ours.state_dict())
        assert (plain(tokens)[..., :VOCAB] - reference).abs().max() > 10 * TOLERANCE
        for architecture, folder in (("auto", "back"), ("dlm", "remote")):
            assert megatron_to_hf.main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / folder),
                                        "--dtype", "float32", "--no-progress", "--hf-architecture", architecture]) == 0
            back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / folder), trust_remote_code=True,
                                                                     dtype=torch.float32).eval()
            assert type(back).__name__ == (type(original).__name__ if architecture == "auto" else "DLMForCausalLM")
            assert (back(tokens).logits - reference).abs().max() <= TOLERANCE, architecture
    capsys.readouterr()
    argv = ["--load", str(tmp_path / "ckpt"), "--hf-path", str(tmp_path / "back")]
    assert verify_correctness_dlm.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 x 64 tokens" in out and "OK" in out  # the default 128 capped by the model, past 16 and 8
    assert verify_correctness_dlm.main(argv + ["--seq-length", "8"]) == 0
    assert "do not reach" in capsys.readouterr().out


def test_yarn_attention_factor_and_rounding_survive_the_round_trip():
    """transformers' explicit attention_factor imports as mscale (mscale_all_dim 0) and exports back."""
    from tools.weights_conversion import hf_rope

    hf = {"max_position_embeddings": 64, "rope_theta": 10000.0, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.25,
        "truncate": False}}
    _, _, fields = hf_rope.import_rope(hf, is_dlm=False)
    config = rope_config(**fields)
    assert inverse_frequencies(16, 10000.0, dataclasses.asdict(config))[1] == pytest.approx(1.25)
    exported = hf_rope.export_rope("qwen3", config)
    assert exported["rope_parameters"]["attention_factor"] == pytest.approx(1.25)
    assert exported["rope_parameters"]["truncate"] is False and exported["rope_scaling"]["rope_type"] == "yarn"


@pytest.mark.parametrize("change,message", [
    ({"max_window_layers": 1}, "sliding window in only some layers"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic' is not supported"),
])
def test_what_cannot_be_expressed_is_refused_in_one_line(change, message, tmp_path, capsys):
    from tools.weights_conversion import hf_to_megatron

    tiny_hf("sliding_window", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("layer_types")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and message in error[0] and not (tmp_path / "ckpt").exists()
