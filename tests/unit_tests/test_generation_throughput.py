"""tools/benchmark/generation_throughput.py on CPU: the JSON it writes, the forward counts of each
variant, the comparison with the baseline, and bad flags. No speed is asserted."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "benchmark"))
import generation_throughput as gt  # noqa: E402

TINY = ["--model", "tiny", "--gen-length", "16", "--block-length", "8", "--prompt-length", "8"]


def test_cli_writes_json_with_counts_and_baseline_comparison(tmp_path):
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, "tools/benchmark/generation_throughput.py", *TINY, "--batch-sizes", "1,2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "| (a) no cache, no threshold |" in proc.stdout and "weights: random init" in proc.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["torch_version"] == torch.__version__
    assert "generation_throughput.py" in result["command"] and "--json" in result["command"]
    config = result["config"]
    steps, gen_length = config["steps"], config["gen_length"]
    assert steps == gen_length == 16 and result["dtype"] == "torch.float32"
    rows = result["rows"]
    assert [(row["batch_size"], row["variant"]) for row in rows] == [(b, v) for b in (1, 2) for v in gt.VARIANTS]
    for row in rows:
        for key in ("tokens_per_sec", "seconds_per_batch", "speedup_vs_baseline", "generated_tokens_per_forward"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["variant"], key, row[key])
        assert len(row["seconds_all"]) == config["repeats"]
        assert row["tokens_per_sec"] == pytest.approx(gen_length * row["batch_size"] / row["seconds_per_batch"])
        if row["variant"] == "ar":  # another decoding of the same weights: not compared token by token
            assert row["token_diff_fraction_vs_baseline"] is None
            assert row["identical_sequence_fraction_vs_baseline"] is None
            continue
        assert 0.0 <= row["token_diff_fraction_vs_baseline"] <= 1.0
        assert 0.0 <= row["identical_sequence_fraction_vs_baseline"] <= 1.0
        assert 1 <= row["forward_calls"] <= steps  # cfg off: at most one forward a step
        if row["threshold"] is None:
            assert row["forward_calls"] == steps  # one token a step: exactly `steps` forwards
        if row["variant"] == "baseline":
            assert row["token_diff_fraction_vs_baseline"] == 0.0
            assert row["identical_sequence_fraction_vs_baseline"] == 1.0
            assert row["speedup_vs_baseline"] == 1.0
    # The caches run fewer tokens per forward: the block (dual) or block onward (prefix) after
    # one full pass per block; without a cache every forward runs the whole canvas.
    canvas, blocks = config["prompt_length"] + gen_length, gen_length // config["block_length"]
    by_name = {(row["batch_size"], row["variant"]): row for row in rows}
    for batch in (1, 2):
        assert by_name[(batch, "baseline")]["model_tokens"] == batch * steps * canvas
        full_passes = batch * blocks * canvas
        later = (steps // blocks - 1) * batch
        assert by_name[(batch, "dual")]["model_tokens"] == full_passes + blocks * later * config["block_length"]
        prefix_tokens = sum(later * (canvas - config["prompt_length"] - block * config["block_length"])
                            for block in range(blocks))
        assert by_name[(batch, "prefix")]["model_tokens"] == full_passes + prefix_tokens
        # AR with a cache: the prompt once, then one token per forward.
        assert by_name[(batch, "ar")]["forward_calls"] == gen_length
        assert by_name[(batch, "ar")]["model_tokens"] == batch * (config["prompt_length"] + gen_length - 1)
    assert "| AR decoding + KV cache (reference) |" in proc.stdout


def test_threshold_that_always_fires_needs_one_forward_per_block(tmp_path):
    """threshold 0: every masked token of the block commits at once, so one forward a block."""
    result = gt.main([*TINY, "--batch-sizes", "2", "--threshold", "0", "--variants", "threshold,dual+threshold",
                      "--repeats", "1", "--warmup", "0"])
    rows = {row["variant"]: row for row in result["rows"]}
    assert rows["baseline"]["forward_calls"] == 16
    assert rows["threshold"]["forward_calls"] == rows["dual+threshold"]["forward_calls"] == 2
    assert rows["threshold"]["generated_tokens_per_forward"] == 8.0
    assert result["config"]["variants"] == ["baseline", "threshold", "dual+threshold"]  # baseline always first


def test_text_prompts_use_the_bundled_tokenizer_for_the_tiny_model():
    result = gt.main([*TINY, "--batch-sizes", "1", "--prompt", "text", "--variants", "baseline", "--repeats", "1",
                      "--warmup", "0"])
    assert result["shape"]["vocab_size"] == 8192 and result["config"]["prompt"] == "text"


def test_checkpoint_of_ours_with_text_prompts_from_the_recorded_tokenizer(tmp_path):
    """--load builds the checkpoint's shape and tokenizes with the files its identity records."""
    pytest.importorskip("transformers")
    from megatron.core.transformer.transformer_config import DLMConfig
    from megatron.training.tokenizer import SentencePieceTokenizer
    from tests.unit_tests.test_hf_conversion import SPM, save_checkpoint, tiny_config

    tokenizer = SentencePieceTokenizer(SPM)
    dlm = DLMConfig(model_running_mode="difflm-shift", mask_token_id=tokenizer.mask)
    save_checkpoint(tmp_path / "ckpt", tiny_config(vocab_size=8192, unpadded_vocab_size=8192), dlm,
                    tokenizer=tokenizer.identity)
    result = gt.main(["--load", str(tmp_path / "ckpt"), "--gen-length", "16", "--block-length", "8",
                      "--prompt-length", "8", "--batch-sizes", "2", "--prompt", "text", "--variants", "prefix",
                      "--repeats", "1", "--warmup", "0"])
    assert result["weights"].startswith("checkpoint ") and result["running_mode"] == "difflm-shift"
    assert result["shape"]["num_layers"] == 2 and result["shape"]["hidden_size"] == 32
    assert [row["forward_calls"] for row in result["rows"]] == [16, 16]


def test_each_threshold_runs_its_own_rows():
    """--threshold 0,0.99: threshold 0 commits a whole block a forward; the rows say which threshold ran."""
    result = gt.main([*TINY, "--batch-sizes", "1", "--threshold", "0,0.99", "--variants", "threshold,dual",
                      "--repeats", "1", "--warmup", "0"])
    rows = [(row["variant"], row["threshold"], row["forward_calls"]) for row in result["rows"]]
    assert rows[0] == ("baseline", None, 16) and rows[3] == ("dual", None, 16)
    assert rows[1] == ("threshold", 0.0, 2) and rows[2][:2] == ("threshold", 0.99)
    assert result["rows"][2]["label"] == "threshold only 0.99"


def _tiny_checkpoints(tmp_path):
    """A DLM and an AR checkpoint of one tiny shape, both with the bundled tokenizer."""
    from megatron.core.transformer.transformer_config import DLMConfig
    from megatron.training.tokenizer import SentencePieceTokenizer
    from tests.unit_tests.test_hf_conversion import SPM, save_checkpoint, tiny_config

    tokenizer = SentencePieceTokenizer(SPM)
    config = tiny_config(vocab_size=8192, unpadded_vocab_size=8192)
    save_checkpoint(tmp_path / "dlm", config, DLMConfig(model_running_mode="difflm-shift",
                                                        mask_token_id=tokenizer.mask), tokenizer=tokenizer.identity)
    save_checkpoint(tmp_path / "ar", config, DLMConfig(model_running_mode="vanilla"), tokenizer=tokenizer.identity)
    return tmp_path / "dlm", tmp_path / "ar"


def test_judge_and_held_out_figures_for_a_dlm_and_its_ar_reference(tmp_path):
    """--judge scores each row; an AR --load runs AR decoding only, and judged by itself its held-out
    log-likelihood and the judge's perplexity of the real text are the same exact number."""
    pytest.importorskip("transformers")
    dlm, ar = _tiny_checkpoints(tmp_path)
    flags = ["--gen-length", "16", "--block-length", "8", "--prompt-length", "8", "--batch-sizes", "2",
             "--prompt", "text", "--repeats", "1", "--warmup", "0", "--judge", str(ar), "--heldout-mc-num", "4"]
    result = gt.main(["--load", str(dlm), *flags, "--variants", "dual+threshold", "--threshold", "0.5,0.9"])
    assert [row["variant"] for row in result["rows"]] == ["baseline", "dual+threshold", "dual+threshold"]
    assert all(row["judge_perplexity"] > 1 for row in result["rows"])
    assert result["rows"][0]["judge_perplexity_vs_baseline"] == 1.0
    assert "ELBO" in result["quality"]["heldout"]["kind"] and result["quality"]["heldout"]["tokens"] == 32
    assert isinstance(result["rows"][1]["first_sequence_text"], str)
    own = gt.main(["--load", str(ar), *flags])
    assert [row["variant"] for row in own["rows"]] == ["ar"]
    heldout, judge = own["quality"]["heldout"], own["quality"]["judge"]
    assert heldout["kind"] == "exact log-likelihood"
    assert math.isclose(heldout["perplexity_bound"], judge["real_text_perplexity"], rel_tol=1e-5)


def test_judge_perplexity_is_the_exact_causal_likelihood(tmp_path):
    """generation_quality.judge_perplexity against a hand-written causal forward over the whole sequence."""
    import generation_quality as quality
    from megatron.training.checkpointing import load_inference_model

    _, ar = _tiny_checkpoints(tmp_path)
    judge = quality.load_judge(str(ar), torch.device("cpu"), vocab_size=8192)
    prompts, continuations = torch.randint(0, 8000, (2, 5)), torch.randint(0, 8000, (2, 7))
    model, _ = load_inference_model(str(ar), torch.device("cpu"))
    sequence = torch.cat([prompts, continuations], dim=1)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    with torch.no_grad():
        logits = model.inference_forward(sequence, torch.arange(12).expand(2, -1), causal, None, 0).float()
    log_probs = logits[:, 4:-1].log_softmax(-1).gather(2, continuations[..., None])
    assert math.isclose(quality.judge_perplexity(judge, prompts, continuations), math.exp(-log_probs.mean().item()),
                        rel_tol=1e-5)
    with pytest.raises(quality.QualityError, match="vocabulary 8192 differs"):
        quality.load_judge(str(ar), torch.device("cpu"), vocab_size=100)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-9"], "unknown --model 'gpt-9'"),
    (["--model", "qwen3-1.7b", "--prompt", "text"], "--prompt text needs a tokenizer"),
    ([*TINY, "--block-length", "5"], "is not a multiple of block_length"),
    ([*TINY, "--steps", "3"], "is not divisible by the 2 blocks"),
    ([*TINY, "--variants", "baseline,fast"], "unknown --variants fast"),
    ([*TINY, "--batch-sizes", "0"], "--batch-sizes [0] must be positive"),
    (["--model", "tiny"], "--prompt-length + --gen-length = 384 exceeds the model's max positions 256"),
    ([*TINY, "--prompt", "text", "--prompt-file", "missing.jsonl"], "--prompt-file missing.jsonl: no such file"),
    ([*TINY, "--threshold", ","], "--threshold needs at least one value"),
    ([*TINY, "--prompt", "chat", "--prompt-file", "examples/data/sotu_1790_1928.jsonl.gz"],
     "line 1: neither 'messages' nor 'prompt'"),
    ([*TINY, "--prompt", "chat", "--batch-sizes", "1000"], "prompts share a token length"),
])
def test_bad_flags_give_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gt.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


CHAT = ["--model", "tiny", "--gen-length", "16", "--block-length", "8", "--prompt", "chat", "--repeats", "1",
        "--warmup", "0"]


def test_chat_prompts_share_one_length_and_their_answers_are_the_references():
    """The bundled chat sample through the training encoder: one prompt length a batch, answers ending at EOS."""
    import generation_tasks as tasks
    from megatron.training.tokenizer import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(gt.BUNDLED_TOKENIZER)
    examples = tasks.chat_examples(tokenizer, gt.BUNDLED_CHAT)
    prompts, answers = tasks.equal_length_batch(examples, 2, gt.BUNDLED_CHAT)
    lengths = [len(prompt) for prompt, _ in examples]
    assert prompts.shape == (2, max(set(lengths), key=lambda n: (lengths.count(n), -n)))
    assert all(answer[-1] == tokenizer.eod for answer in answers)
    assert [p.tolist() + a for p, a in zip(prompts, answers)] == [p + a for p, a in examples
                                                                   if len(p) == prompts.shape[1]][:2]
    with pytest.raises(tasks.TaskError, match="at most .* prompts share a token length"):
        tasks.equal_length_batch(examples, len(examples) + 1, gt.BUNDLED_CHAT)


def test_answer_figures_cut_each_row_at_its_first_eos():
    import generation_tasks as tasks

    eos = 2
    generated = torch.tensor([[5, 6, 2, 2], [5, 7, 2, 9], [5, 6, 7, 8]])
    figures = tasks.answer_figures(generated, [[5, 6, 2, 4], [5, 6, 2], [5, 6, 7, 8]], eos)
    assert figures["answers"] == [[5, 6, 2], [5, 7, 2], [5, 6, 7, 8]]
    assert figures["eos_rate"] == pytest.approx(2 / 3) and figures["exact_match"] == pytest.approx(2 / 3)
    assert figures["answer_tokens"] == pytest.approx(10 / 3)
    assert [row.tolist() for row in tasks.first_eos_cut(generated, eos)] == [[5, 6, 2], [5, 7, 2], [5, 6, 7, 8]]


def test_chat_rows_stop_at_eos_in_every_variant(monkeypatch):
    """A model that always prefers EOS: every variant stops each row after its first token, so the
    answers are one EOS long and fewer forwards run than the canvas has tokens."""
    made = gt.random_bench

    def eos_loving(args, device):
        bench = made(args, device)
        forward = bench.model.inference_forward

        def prefers_eos(*inputs):
            logits = forward(*inputs).clone()
            logits[..., bench.tokenizer.eod] = logits.amax(-1) + 20
            return logits
        bench.model.inference_forward = prefers_eos
        return bench

    monkeypatch.setattr(gt, "random_bench", eos_loving)
    result = gt.main([*CHAT, "--batch-sizes", "2", "--variants", "dual+threshold,ar", "--threshold", "0.9"])
    for row in result["rows"]:
        assert row["eos_rate"] == 1.0 and row["answer_tokens"] == 1.0 and row["exact_match"] == 0.0, row["label"]
        assert row["forward_calls"] < 16 and row["answer_tokens_per_sec"] > 0
    assert result["config"]["prompt_file"] == "examples/data/chat_sample.jsonl"
    assert result["quality"]["heldout"]["tokens"] > 2 and result["config"]["eos_stop"]
    # --no-eos-stop: the whole canvas, as LLaDA decodes it: one token a step for (a), one block a step
    # for the threshold (every EOS is confident), the same one-EOS answers.
    full = gt.main([*CHAT, "--batch-sizes", "2", "--variants", "threshold", "--threshold", "0.9", "--no-eos-stop"])
    assert [row["forward_calls"] for row in full["rows"]] == [16, 2] and not full["config"]["eos_stop"]
    assert all(row["answer_tokens"] == 1.0 and row["eos_rate"] == 1.0 for row in full["rows"])


def test_chat_without_a_forced_eos_runs_the_whole_canvas():
    result = gt.main([*CHAT, "--batch-sizes", "1", "--variants", "baseline"])
    row = result["rows"][0]
    assert row["forward_calls"] == 16 or row["eos_rate"] == 1.0
    assert 1 <= row["answer_tokens"] <= 16 and result["config"]["prompt"] == "chat"


def test_a_perplexity_past_float_range_is_infinite_not_an_error():
    import generation_quality as quality

    assert quality.perplexity(1.0) == pytest.approx(math.e) and quality.perplexity(1e4) == math.inf


@pytest.mark.parametrize("prompt, content, message", [
    ("chat", b"\x1f\x8b\x08\x00broken", "unreadable after line 0 (EOFError)"),
    ("text", b"\x1f\x8b\x08\x00broken", "unreadable after line 0"),
    ("chat", b'{"prompt": "a", "response": "b"}\nnot json\n', "line 2: not JSON"),
    ("text", b'{"title": "no text"}\n', 'line 1 has no string "text" field'),
])
def test_a_broken_prompt_file_is_one_line_before_any_work(prompt, content, message, tmp_path, capsys):
    path = tmp_path / ("p.jsonl.gz" if content.startswith(b"\x1f\x8b") else "p.jsonl")
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        gt.main([*TINY, "--prompt", prompt, "--prompt-file", str(path), "--batch-sizes", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_a_joint_ar_dlm_checkpoint_is_decoded_under_its_trained_attention(tmp_path):
    """The joint objective's clean blocks are token-causal (DLMConfig.causal_clean_half): the tool decodes under
    the model's own trained pattern, so its output is the model's own `generate`; the bidirectional clean
    blocks it once used (a pattern of its own, without causal_clean) decode something else."""
    from megatron.core.inference import generation
    from megatron.core.transformer.transformer_config import DLMConfig
    from tests.unit_tests.test_hf_conversion import save_checkpoint, tiny_config

    dlm = DLMConfig(model_running_mode="difflm-noshift", block_diffusion=True, block_size=4, ar_loss_weight=1.0,
                    mask_token_id=89)
    save_checkpoint(tmp_path / "ckpt", tiny_config(init_method_std=1.0), dlm)  # logits that vary with the context
    args = gt.build_parser().parse_args(["--load", str(tmp_path / "ckpt"), "--gen-length", "8", "--block-length",
                                         "4", "--prompt-length", "8", "--device", "cpu", "--warmup", "0",
                                         "--repeats", "1"])
    gt.validate(args)
    bench = gt.checkpoint_bench(args, torch.device("cpu"))
    assert bench.pattern == bench.model.trained_pattern() and bench.pattern["causal_clean"]
    prompts = torch.randint(0, 80, (2, 8), generator=torch.Generator().manual_seed(0))
    tool = gt.run_variant(bench, prompts, gt.VARIANTS["baseline"], None, args, torch.device("cpu"))["output"]
    ours = bench.model.generate(prompts, gen_length=8, block_length=4, steps=args.steps, temperature=0.0)
    assert torch.equal(tool, ours)
    options = dict(bench.pattern, causal_clean=False, running_mode=bench.model.running_mode, mask_token_id=89)
    bidirectional = generation.generate(bench.model.inference_forward, prompts, gen_length=8, block_length=4,
                                        steps=args.steps, temperature=0.0, **options)
    assert not torch.equal(bidirectional, ours)
