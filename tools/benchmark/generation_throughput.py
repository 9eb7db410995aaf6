"""DLM generation throughput: LLaDA's sampler against the Fast-dLLM speed-ups (KV cache, threshold).

    python tools/benchmark/generation_throughput.py --model qwen3-1.7b --batch-sizes 1,8 \
        [--gen-length 256 --block-length 32 --steps 256 --threshold 0.5,0.7,0.9] [--prompt-length 128] \
        [--prompt random|text|chat [--prompt-file JSONL]] [--load CKPT [--tokenizer-model FILE]] [--variants ...] \
        [--judge AR_CKPT] [--json OUT]

The model is our `GPTModel` (random init of the named shape, or `--load` a checkpoint of ours,
whose metadata gives the shape), bf16 weights on CUDA, fp32 on CPU, driven through
`megatron.core.inference.generation.generate` with `GPTModel.inference_forward`, greedy
(temperature 0) and, except with `--prompt chat`, without an EOS stop, so every variant generates
all `--gen-length` tokens.
Variants (a) baseline: no cache, no threshold, `--steps` steps (default one token per step,
LLaDA's default); (b) dual cache + threshold; (c) prefix cache + threshold; and the cache or the
threshold alone; and `ar`, the reference a DLM is weighed against: the same network decoding
autoregressively (causal masks, KV cache, one token per forward), which costs what an AR model
of this shape costs. `--threshold` takes a comma-separated list: each threshold variant runs once
per value. An autoregressive (`vanilla`) checkpoint runs the `ar` variant only. Per batch size and
variant: tokens/s (generated tokens x batch / seconds), the
median seconds of one `generate` call over `--repeats` calls after `--warmup` calls (CUDA events
on GPU, wall clock on CPU), the model forward calls and the tokens they ran, the speed-up over
(a), and how far the output moves from (a): the fraction of generated tokens that differ and
the fraction of sequences that are identical.

A random-init model has flat confidences: the threshold then almost never fires (threshold
variants make as many forwards as (a)) and near-ties make the cached outputs diverge more than a
trained model's would. `--load` a trained checkpoint to measure the threshold's effect; the
table header says which weights were used.

Quality (generation_quality.py), with `--prompt text`: the prompts are slices of real text
(`--prompt-file`, default the bundled speeches) and the next `--gen-length` tokens of that text
are their real continuations. The header gives the model's held-out log-likelihood of those
(ELBO for a DLM); `--judge AR_CKPT` adds each row's judge perplexity of the generated text and of
the real continuation, the figure a variant's speed-up is weighed against.

With `--prompt chat` the prompts are SFT records (generation_tasks.py; tools/build_verse_task.py
writes a held-out set) and every variant stops each row at its first committed EOS, as an answer
ends (`--no-eos-stop`: every variant decodes the whole canvas, LLaDA's and Fast-dLLM's protocol,
where the tail of EOS is what threshold decoding commits in parallel). The rows add the answers'
tokens per second (up to each row's first EOS; tokens/s still counts the whole canvas), their
mean length, the fraction that stop at EOS and the fraction equal to the reference answer; the
judge scores each answer up to its EOS, and the held-out likelihood is that of the reference
answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import generation_quality as quality  # noqa: E402
import generation_tasks as tasks  # noqa: E402
import train_throughput as shapes  # noqa: E402  (the named model shapes, shared with the training benchmark)

from megatron.core.inference import generation  # noqa: E402
from megatron.core.inference.cuda_graphs import CUDAGraphRunner  # noqa: E402
from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.compilation import compile_transformer_layers  # noqa: E402
from megatron.core.transformer.transformer_config import ATTENTION_BACKENDS, DLMConfig  # noqa: E402
from megatron.training.checkpointing import load_inference_model  # noqa: E402

BUNDLED_TOKENIZER = os.path.join(ROOT, "examples", "data", "tokenizer", "spm_8k.model")
BUNDLED_TEXT = os.path.join(ROOT, "examples", "data", "sotu_1790_1928.jsonl.gz")
BUNDLED_CHAT = os.path.join(ROOT, "examples", "data", "chat_sample.jsonl")
WITH_TOKENIZER = ("text", "chat")
UsageError = shapes.UsageError


@dataclass(frozen=True)
class Variant:
    label: str
    cache: Optional[str]
    use_threshold: bool
    autoregressive: bool = False


VARIANTS: Dict[str, Variant] = {
    "baseline": Variant("(a) no cache, no threshold", None, False),
    "dual+threshold": Variant("(b) dual cache + threshold", "dual", True),
    "prefix+threshold": Variant("(c) prefix cache + threshold", "prefix", True),
    "dual": Variant("dual cache only", "dual", False),
    "prefix": Variant("prefix cache only", "prefix", False),
    "threshold": Variant("threshold only", None, True),
    "ar": Variant("AR decoding + KV cache (reference)", None, False, autoregressive=True),
}


@dataclass
class Bench:
    """The model under test and what generation needs to know about it."""

    model: GPTModel
    mask_token_id: int
    pattern: dict
    """The attention the model was trained with (as GPTModel.generate passes it)."""
    weights: str
    """A line for the table header: random init or which checkpoint."""
    max_positions: int
    tokenizer: object = None
    graphs: Optional[CUDAGraphRunner] = None
    """With --cuda-graphs: the model_fn, replaying graphs over `model.inference_forward`."""
    judge: Optional[quality.Judge] = None
    eos: Optional[int] = None
    """With --prompt chat: the tokenizer's EOS, where each answer ends."""
    stop_at_eos: bool = False
    """--eos-stop: every variant stops a row at its first EOS (generate's eos_token_id)."""
    text: Optional[torch.Tensor] = None
    """With --prompt text: the prompt file's first tokens, enough for the largest batch (read once)."""
    task: Optional[Tuple[torch.Tensor, List[List[int]]]] = None
    """With --prompt chat: the largest batch's prompts and their reference answers (generation_tasks.py)."""


# ---------------------------------------------------------------------- the model
def _finish(model: GPTModel, device: torch.device) -> GPTModel:
    """Inference precision: bf16 weights on CUDA (no per-forward casts of fp32 masters), fp32 on CPU."""
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    return model.eval()


def _bench_of(model: GPTModel, weights: str, tokenizer=None) -> Bench:
    # the attention it was trained under (a joint AR + DLM model's clean blocks token-causal included)
    return Bench(model, model.dlm_config.mask_token_id, model.trained_pattern(), weights,
                 model.config.max_position_embeddings, tokenizer)


def random_bench(args: argparse.Namespace, device: torch.device) -> Bench:
    """The named shape at random init; the tiny model takes the bundled tokenizer's vocabulary for text prompts."""
    spec = shapes.MODELS[args.model]
    tokenizer = None
    if args.prompt in WITH_TOKENIZER:
        tokenizer = _build_tokenizer("SentencePieceTokenizer", BUNDLED_TOKENIZER)
        spec = dataclasses.replace(spec, vocab_size=tokenizer.vocab_size)
    mask = tokenizer.mask if tokenizer is not None and tokenizer.mask is not None else spec.vocab_size - 1
    config = shapes.transformer_config(spec, device, args.attention_backend)
    dlm = DLMConfig(model_running_mode="difflm-noshift", attention_mask_type="no_mask", mask_token_id=mask,
                    seed=args.seed)
    torch.manual_seed(args.seed)
    with torch.device(device):  # no host-side init of billions of weights
        model = GPTModel(config, dlm)
    return _bench_of(_finish(model, device), f"random init (seed {args.seed}; flat confidences, see the docstring)",
                     tokenizer)


def checkpoint_bench(args: argparse.Namespace, device: torch.device) -> Bench:
    """The latest checkpoint under --load, in one process whatever layout it was saved with."""
    try:
        model, metadata = load_inference_model(args.load, device, args.attention_backend)
    except ValueError as error:
        raise UsageError(str(error)) from None
    tokenizer = _checkpoint_tokenizer(metadata.get("tokenizer") or {}, args) if args.prompt in WITH_TOKENIZER else None
    return _bench_of(model.eval(), f"checkpoint {os.path.abspath(metadata['source'])}", tokenizer)


def _build_tokenizer(kind: str, tokenizer_model: str):
    from megatron.training.tokenizer import build_tokenizer

    return build_tokenizer(argparse.Namespace(tokenizer_type=kind, tokenizer_model=tokenizer_model))


def _checkpoint_tokenizer(identity: dict, args: argparse.Namespace):
    """The training tokenizer: --tokenizer-model or the files the checkpoint records, checked by sha256."""
    from megatron.training.tokenizer.identity import TokenizerIdentityError, rebuild_training_tokenizer

    try:
        tokenizer = rebuild_training_tokenizer(identity, tokenizer_model=args.tokenizer_model)
    except (TokenizerIdentityError, OSError, ValueError) as error:
        raise UsageError(f"--prompt {args.prompt}: {error}") from None
    if tokenizer is None:
        raise UsageError(f"--prompt {args.prompt}: the checkpoint was trained with a NullTokenizer; "
                         "use --prompt random")
    return tokenizer


# ---------------------------------------------------------------------- prompts
def text_tokens(tokenizer, count: int, path: str = BUNDLED_TEXT) -> List[int]:
    """The first `count` tokens of a JSONL(.gz) file's "text" fields, document after document."""
    tokens: List[int] = []
    for number, record in tasks.records(path):
        if not isinstance(record.get("text") if isinstance(record, dict) else None, str):
            raise UsageError(f"--prompt-file {path} line {number} has no string \"text\" field; give JSONL "
                             "documents with one")
        tokens += [t for t in tokenizer.tokenize(record["text"]) if t != tokenizer.mask]
        if len(tokens) >= count:
            return tokens[:count]
    raise UsageError(f"{path} has only {len(tokens)} tokens; lower --prompt-length, --gen-length or the batch size")


def prompt_batch(bench: Bench, args: argparse.Namespace, batch_size: int,
                 device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """([batch, prompt_length] prompts, their real continuations [batch, gen_length] or None): seeded
    random ids (never the mask id; no continuation), consecutive slices of real text, or chat prompts
    and their reference answers (a list of 1-D id tensors, each ending in EOS)."""
    length = args.prompt_length
    if args.prompt == "chat":
        prompts, answers = bench.task
        return prompts[:batch_size].to(device), [torch.tensor(answer, device=device) for answer in answers[:batch_size]]
    if args.prompt == "text":
        row = length + args.gen_length
        rows = bench.text[:batch_size * row].view(batch_size, row).to(device)
        return rows[:, :length].contiguous(), rows[:, length:].contiguous()
    vocab = bench.model.config.vocab_size
    ids = torch.randint(0, vocab - 1, (batch_size, length), generator=torch.Generator().manual_seed(args.seed))
    if bench.mask_token_id is not None:
        ids[ids >= bench.mask_token_id] += 1  # skip the mask id, stay inside the vocabulary
    return ids.to(device), None


# ---------------------------------------------------------------------- timing
def _now(device: torch.device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(start, end, device: torch.device) -> float:
    if device.type == "cuda":
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return end - start


def run_variant(bench: Bench, prompts: torch.Tensor, variant: Variant, threshold: Optional[float],
                args: argparse.Namespace, device: torch.device) -> dict:
    """Warm up, then time `--repeats` generate calls; forwards, model tokens and the output of the last."""
    counts = {"forwards": 0, "tokens": 0}

    def model_fn(ids, positions, mask, cache, start):
        counts["forwards"] += 1
        counts["tokens"] += ids.numel()
        return (bench.graphs or bench.model.inference_forward)(ids, positions, mask, cache, start)

    if variant.autoregressive:  # the same network decoding causally: the cost of an AR model of this shape
        options = dict(running_mode="vanilla", attention_mask_type="causal", use_cache=True)
    else:
        options = dict(bench.pattern, running_mode=bench.model.running_mode, mask_token_id=bench.mask_token_id,
                       block_length=args.block_length, steps=args.steps, cache=variant.cache,
                       threshold=threshold)
    if bench.stop_at_eos:
        options["eos_token_id"] = bench.eos

    def once() -> torch.Tensor:
        return generation.generate(model_fn, prompts, gen_length=args.gen_length, temperature=0.0, **options)

    for _ in range(args.warmup):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds, outputs, per_call = [], [], []
    for _ in range(args.repeats):
        counts.update(forwards=0, tokens=0)
        start = _now(device)
        outputs.append(once())
        seconds.append(_seconds(start, _now(device), device))
        per_call.append(dict(counts))
    if any(call != per_call[0] for call in per_call):
        raise RuntimeError(f"{variant.label}: the forward count changed between identical calls: {per_call}")
    return {"seconds": seconds, "forward_calls": per_call[0]["forwards"], "model_tokens": per_call[0]["tokens"],
            "output": outputs[-1], "repeats_identical": all(torch.equal(o, outputs[0]) for o in outputs),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def variant_plan(args: argparse.Namespace) -> List[Tuple[str, Optional[float]]]:
    """(variant, threshold) in run order: each threshold variant once per --threshold value."""
    return [(name, threshold) for name in args.variants
            for threshold in (args.threshold if VARIANTS[name].use_threshold else [None])]


def _row(batch_size: int, name: str, threshold: Optional[float], run: dict, generated: torch.Tensor,
         baseline: dict, gen_length: int) -> dict:
    seconds = statistics.median(run["seconds"])
    # An AR decode of a DLM's weights answers another question: its tokens are not compared.
    compare = not VARIANTS[name].autoregressive or VARIANTS[baseline["variant"]].autoregressive
    same_tokens = generated == baseline["generated"] if compare else None
    label = VARIANTS[name].label + ("" if threshold is None else f" {threshold:g}")
    return {"batch_size": batch_size, "variant": name, "label": label, "cache": VARIANTS[name].cache,
            "threshold": threshold, "seconds_per_batch": seconds, "seconds_all": run["seconds"],
            "tokens_per_sec": gen_length * batch_size / seconds,
            "forward_calls": run["forward_calls"], "model_tokens": run["model_tokens"],
            "generated_tokens_per_forward": gen_length / run["forward_calls"],
            "speedup_vs_baseline": statistics.median(baseline["seconds"]) / seconds,
            "token_diff_fraction_vs_baseline": None if same_tokens is None else
            1.0 - same_tokens.float().mean().item(),
            "identical_sequence_fraction_vs_baseline": None if same_tokens is None else
            same_tokens.all(dim=1).float().mean().item(),
            "repeats_identical": run["repeats_identical"], "peak_memory_gib": run["peak_memory_gib"]}


def measure(bench: Bench, args: argparse.Namespace, device: torch.device) -> List[dict]:
    """One row per (batch size, variant, threshold); the first of each batch size is the baseline."""
    rows = []
    for batch_size in args.batch_sizes:
        prompts, continuations = prompt_batch(bench, args, batch_size, device)
        baseline = None
        for name, threshold in variant_plan(args):
            run = run_variant(bench, prompts, VARIANTS[name], threshold, args, device)
            generated = run.pop("output")[:, prompts.shape[1]:]
            if baseline is None:
                baseline = dict(run, generated=generated, variant=name)
            row = _row(batch_size, name, threshold, run, generated, baseline, args.gen_length)
            if bench.eos is not None:
                _add_answer_figures(row, generated, continuations, bench.eos)
            if bench.tokenizer is not None:  # what the first sequence says, for the reader of the JSON
                first = tasks.first_eos_cut(generated[:1], bench.eos)[0]
                row["first_sequence_text"] = bench.tokenizer.detokenize(first.tolist())
            if bench.judge is not None:
                row["judge_perplexity"] = quality.judge_perplexity(bench.judge, prompts,
                                                                   tasks.first_eos_cut(generated, bench.eos))
                baseline.setdefault("judge_perplexity", row["judge_perplexity"])
                row["judge_perplexity_vs_baseline"] = row["judge_perplexity"] / baseline["judge_perplexity"]
            rows.append(row)  # progress: long runs show each row as it completes
            print(f"batch {batch_size} {row['label']}: {row['tokens_per_sec']:.1f} tokens/s, "
                  f"{row['seconds_per_batch']:.3f} s, {row['forward_calls']} forwards", flush=True)
    return rows


def _add_answer_figures(row: dict, generated: torch.Tensor, references: List[List[int]], eos: int) -> None:
    """Chat rows: EOS rate, exact match and answer length, and the answers' tokens per second (up to
    each row's first EOS: the text a user reads, whatever the canvas length)."""
    figures = tasks.answer_figures(generated, references, eos)
    del figures["answers"]
    row.update(figures, answer_tokens_per_sec=figures["answer_tokens"] * row["batch_size"] / row["seconds_per_batch"])


# ---------------------------------------------------------------------- report
def print_table(result: dict) -> None:
    config = result["config"]
    print(f"\nDLM generation throughput: {result['model']} on {result['device']} (torch {result['torch_version']})")
    print(f"weights: {result['weights']}")
    print(f"prompt {config['prompt']} x {config['prompt_length']} tokens, gen_length {config['gen_length']}, "
          f"block_length {config['block_length']}, steps {config['steps']}, threshold {config['threshold']}, "
          f"greedy, {'each row stops at EOS' if config.get('eos_stop') else 'no EOS stop'}; median of "
          f"{config['repeats']} calls after {config['warmup']} warm-up")
    graphs = result.get("cuda_graphs")
    print(f"compiled layers: {'yes' if config['torch_compile'] else 'no'}; CUDA graphs: "
          + (f"{graphs['captured']} captured, {graphs['replays']} forwards replayed\n" if graphs else "no\n"))
    print_quality(result.get("quality"))
    judged, chat = "judge_perplexity" in result["rows"][0], "eos_rate" in result["rows"][0]
    print("| batch | variant | tokens/s | s / batch | forwards | model tokens | gen tokens / forward "
          "| speed-up vs (a) | tokens ≠ (a) | sequences = (a) | peak GiB |"
          + (" judge ppl | ppl / (a) |" if judged else "") + (" answer tokens/s | answer tokens | EOS | exact |"
                                                              if chat else ""))
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if judged else "")
          + ("---:|---:|---:|---:|" if chat else ""))
    for row in result["rows"]:
        peak = "-" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.1f}"
        differ, same = row["token_diff_fraction_vs_baseline"], row["identical_sequence_fraction_vs_baseline"]
        judge = (f" {row['judge_perplexity']:.2f} | {row['judge_perplexity_vs_baseline']:.3f} |" if judged else "")
        print(f"| {row['batch_size']} | {row['label']} | {row['tokens_per_sec']:.1f} | {row['seconds_per_batch']:.3f} "
              f"| {row['forward_calls']} | {row['model_tokens']:,} | {row['generated_tokens_per_forward']:.2f} "
              f"| {row['speedup_vs_baseline']:.2f}x | {'-' if differ is None else f'{100 * differ:.1f}%'} "
              f"| {'-' if same is None else f'{100 * same:.0f}%'} | {peak} |" + judge + (
                  f" {row['answer_tokens_per_sec']:.1f} | {row['answer_tokens']:.1f} | {100 * row['eos_rate']:.0f}% "
                  f"| {100 * row['exact_match']:.0f}% |" if chat else ""))
    if not all(row["repeats_identical"] for row in result["rows"]):
        print("note: some variant gave different outputs on identical calls (nondeterministic kernels)")


def print_quality(figures: Optional[dict]) -> None:
    if not figures:
        return
    heldout = figures["heldout"]
    print(f"held-out ({heldout['tokens']} tokens of the real continuations): {heldout['kind']} "
          f"{heldout['nats_per_token']:.4f} nats/token, perplexity {'<= ' if 'ELBO' in heldout['kind'] else ''}"
          f"{heldout['perplexity_bound']:.2f}")
    if "judge" in figures:
        print(f"judge {figures['judge']['source']}: perplexity of the real continuations "
              f"{figures['judge']['real_text_perplexity']:.2f}\n")


def quality_reference(bench: Bench, args: argparse.Namespace, device: torch.device) -> Optional[dict]:
    """With text prompts: the held-out likelihood of the real continuations (largest batch's prompts),
    and the judge's perplexity of them."""
    if args.prompt not in WITH_TOKENIZER:
        return None
    prompts, continuations = prompt_batch(bench, args, max(args.batch_sizes), device)
    figures = {"heldout": quality.heldout_log_likelihood(bench.model, bench.pattern, bench.mask_token_id, prompts,
                                                         continuations, args.heldout_mc_num, args.seed)}
    if bench.judge is not None:
        figures["judge"] = {"source": bench.judge.source,
                            "real_text_perplexity": quality.judge_perplexity(bench.judge, prompts, continuations)}
    return figures


def _list_of(kind: type, what: str):
    """An argparse type: a comma-separated list of `kind`."""
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}") from None
    return parse


_float_list, _int_list = _list_of(float, "numbers"), _list_of(int, "integers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", help=f"A named shape: {', '.join(shapes.MODELS)}.")
    parser.add_argument("--load", help="A --save directory of ours (its shape wins over --model).")
    parser.add_argument("--tokenizer-model", help="With --load --prompt text: the training tokenizer "
                        "(default: the files the checkpoint records).")
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 8])
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps", type=int, help="Denoising steps of (a); default gen-length (one token a step).")
    parser.add_argument("--threshold", type=_float_list, default=[0.9],
                        help="Confidence threshold(s) of the threshold variants, comma-separated: one row each.")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--prompt", choices=["random", "text", "chat"], default="random",
                        help="Seeded random ids, the bundled speeches, or chat records whose answers end at EOS "
                             "(bundled tokenizer for the tiny model, the checkpoint's with --load).")
    parser.add_argument("--prompt-file",
                        help="With --prompt text: a JSONL(.gz) whose \"text\" fields give the prompts and their "
                             "real continuations (default: the bundled speeches). With --prompt chat: SFT records "
                             "(prompt/response or messages; default examples/data/chat_sample.jsonl), prompts of "
                             "one token length (generation_tasks.py).")
    parser.add_argument("--eos-stop", action=argparse.BooleanOptionalAction, default=True,
                        help="With --prompt chat: stop each row at its first EOS (default), or, with --no-eos-stop, "
                             "decode the whole canvas as LLaDA and Fast-dLLM do (the answers still end at EOS).")
    parser.add_argument("--chat-template", default="auto",
                        help="With --prompt chat: as tools/preprocess_data.py's (auto: the tokenizer's, else builtin).")
    parser.add_argument("--judge", help="An AR (vanilla) checkpoint of ours, same tokenizer: each row's perplexity "
                        "of the generated text under it (generation_quality.py).")
    parser.add_argument("--heldout-mc-num", type=int, default=32,
                        help="Masked copies a row of the held-out ELBO of a DLM (--prompt text).")
    parser.add_argument("--variants", type=lambda text: [v for v in text.split(",") if v],
                        default=list(VARIANTS), help=f"Comma-separated, from {', '.join(VARIANTS)}; "
                        "the baseline is always run first.")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", help="Default: cuda when available, else cpu.")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--torch-compile", action="store_true",
                        help="torch.compile each transformer layer (dynamic shapes: the canvas, block and "
                             "cache offsets change between forwards).")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="Replay a CUDA graph per forward shape (megatron.core.inference.cuda_graphs; CUDA only, "
                             "composes with --torch-compile). The warm-up calls capture them.")
    parser.add_argument("--json", help="Write every number, the command and versions here.")
    return parser


def validate(args: argparse.Namespace) -> None:
    if args.load is None and args.model not in shapes.MODELS:
        raise UsageError(f"unknown --model {args.model!r}; choose one of {', '.join(shapes.MODELS)}")
    if args.prompt_file is None:
        args.prompt_file = BUNDLED_CHAT if args.prompt == "chat" else BUNDLED_TEXT
    if args.prompt in WITH_TOKENIZER and args.load is None and args.model != "tiny":
        raise UsageError(f"--prompt {args.prompt} needs a tokenizer of the model's vocabulary: use --model tiny "
                         "(bundled tokenizer) or --load a checkpoint; else --prompt random")
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown --variants {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    args.variants = ["baseline"] + [name for name in dict.fromkeys(args.variants) if name != "baseline"]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise UsageError(f"--batch-sizes {args.batch_sizes} must be positive integers")
    for flag in ("prompt_length", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup} must be at least 0")
    if args.cuda_graphs and (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0] != "cuda":
        raise UsageError("--cuda-graphs needs a CUDA device; drop it on CPU")
    if args.attention_backend not in ATTENTION_BACKENDS:
        raise UsageError(f"--attention-backend {args.attention_backend!r} is not one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    args.steps = args.steps or args.gen_length
    if not args.threshold:
        raise UsageError("--threshold needs at least one value")
    if args.prompt in WITH_TOKENIZER and not os.path.isfile(args.prompt_file):
        raise UsageError(f"--prompt-file {args.prompt_file}: no such file")
    if args.heldout_mc_num < 1:
        raise UsageError(f"--heldout-mc-num {args.heldout_mc_num} must be at least 1")
    for threshold in (None, *args.threshold):
        try:
            generation.resolve_options("difflm-noshift", gen_length=args.gen_length, block_length=args.block_length,
                                       steps=args.steps, threshold=threshold)
        except ValueError as error:
            raise UsageError(str(error)) from None


def setup(args: argparse.Namespace, device: torch.device) -> Bench:
    """Check the flags, load the model (and the judge), or print one line and exit 2."""
    try:
        validate(args)
        bench = checkpoint_bench(args, device) if args.load else random_bench(args, device)
        if bench.model.running_mode == "vanilla":  # an AR model decodes autoregressively: its one variant
            args.variants = ["ar"]
        if args.prompt == "chat":
            bench.eos = bench.tokenizer.eod
            bench.stop_at_eos = args.eos_stop
            examples = tasks.chat_examples(bench.tokenizer, args.prompt_file, args.chat_template)
            bench.task = tasks.equal_length_batch(examples, max(args.batch_sizes), args.prompt_file)
            args.prompt_length = bench.task[0].shape[1]
        if args.prompt_length + args.gen_length > bench.max_positions:
            raise UsageError(f"--prompt-length + --gen-length = {args.prompt_length + args.gen_length} exceeds the "
                             f"model's max positions {bench.max_positions}; shorten them")
        if args.prompt == "text":
            needed = max(args.batch_sizes) * (args.prompt_length + args.gen_length)
            bench.text = torch.tensor(text_tokens(bench.tokenizer, needed, args.prompt_file))
        if args.judge:
            bench.judge = quality.load_judge(args.judge, device, bench.model.config.vocab_size, args.attention_backend)
    except (UsageError, quality.QualityError, tasks.TaskError) as error:
        print(f"generation_throughput.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    if args.torch_compile:
        compile_transformer_layers(bench.model, dynamic=True)
    if args.cuda_graphs:
        bench.graphs = CUDAGraphRunner(bench.model.inference_forward)
    return bench


def main(argv: Optional[List[str]] = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bench = setup(args, device)
    config = bench.model.config
    result = {
        "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "model": args.load or args.model, "weights": bench.weights, "running_mode": bench.model.running_mode,
        "parameters": sum(p.numel() for p in bench.model.parameters()),
        "dtype": str(next(bench.model.parameters()).dtype),
        "shape": {name: getattr(config, name) for name in ("num_layers", "hidden_size", "num_attention_heads",
                                                           "num_query_groups", "kv_channels", "ffn_hidden_size",
                                                           "vocab_size", "qk_layernorm")},
        "config": {name: getattr(args, name) for name in ("batch_sizes", "gen_length", "block_length", "steps",
                                                          "threshold", "prompt", "prompt_length", "variants",
                                                          "warmup", "repeats", "seed", "attention_backend",
                                                          "torch_compile", "cuda_graphs", "judge")}
        | ({"eos_stop": args.eos_stop} if args.prompt == "chat" else {}),
        "quality": quality_reference(bench, args, device),
        "rows": measure(bench, args, device),
    }
    if args.prompt in WITH_TOKENIZER:
        result["config"]["prompt_file"] = os.path.relpath(os.path.abspath(args.prompt_file), ROOT)
    if bench.graphs is not None:
        result["cuda_graphs"] = {"captured": len(bench.graphs.graphs), "replays": bench.graphs.replays}
    print_table(result)
    if args.json:
        shapes.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
