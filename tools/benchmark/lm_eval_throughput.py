"""Multiple-choice scoring throughput: our batched scorer against one question at a time.

lm-eval hands the model every (context, continuation) pair of a task at once. LLaDA's adapter
scores them one by one: for each pair, `mc_num` masked copies, `batch_size` copies per forward
(its commands: mc_num 128, batch 8). Ours (megatron/evaluation/scoring.py, what the `megadlms`
lm-eval model runs) streams the copies of all pairs, sorted by length, in batches of
`--batch-size` rows, and applies the output layer only at the scored slots (``select``; the
loop, like LLaDA's, makes the full logits). Both compute the same estimate; this times them on
the same synthetic questions (random token ids, random weights: throughput only) and prints
questions/s, in total and as the median over `--repeats` consecutive parts of the questions.
Ours also runs a pair's equal masked copies once (weighted by their count: the same estimate;
a short continuation has few distinct masks), which LLaDA's loop does not.
`--lever-questions N` also times, on the first N questions, our scorer with full logits, with
twice the batch size and with every copy run; the padded fraction of the row slots, length-sorted as the scorer
runs them and in the questions' own order, is counted without the device.

    python tools/benchmark/lm_eval_throughput.py --model qwen3-1.7b --questions 200 --choices 4 \\
        --mc-num 128 --loop-batch-size 8 --batch-size 256 --loop-questions 40 --repeats 5 --lever-questions 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_throughput as shapes  # noqa: E402  (the named model shapes, shared with the training benchmark)

from megatron.core.inference.likelihood import draw_masks  # noqa: E402
from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.compilation import compile_transformer_layers  # noqa: E402
from megatron.core.transformer.transformer_config import DLMConfig  # noqa: E402
from megatron.evaluation.scoring import Scorer, pair_seed  # noqa: E402


def build_model(name: str, device: torch.device, seed: int) -> GPTModel:
    spec = shapes.MODELS[name]
    config = shapes.transformer_config(spec, device)
    dlm = DLMConfig(model_running_mode="difflm-noshift", attention_mask_type="no_mask",
                    mask_token_id=spec.vocab_size - 1, seed=seed)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPTModel(config, dlm)
    model = model.to(device)
    return (model.to(torch.bfloat16) if device.type == "cuda" else model).eval()


def questions(count: int, choices: int, vocab: int, context: tuple, answer: tuple, seed: int) -> list:
    """(context, [continuations]) with lengths drawn uniformly from the given ranges."""
    rng = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list:
        length = int(torch.randint(low, high + 1, (), generator=rng))
        return torch.randint(0, vocab - 1, (length,), generator=rng).tolist()

    return [(ids(*context), [ids(*answer) for _ in range(choices)]) for _ in range(count)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunks(items: list, repeats: int) -> list:
    """`items` cut into `repeats` consecutive, nearly equal parts (each timed alone: a median)."""
    size = -(-len(items) // repeats)
    return [items[start:start + size] for start in range(0, len(items), size)]


def time_batched(model: GPTModel, items: list, args, device: torch.device, *, select: bool = True,
                 batch_size: Optional[int] = None, dedupe: bool = True) -> tuple:
    """(seconds, scores) of the batched scorer; `select`: the output layer at the scored slots only;
    `dedupe`: a pair's equal masked copies run once."""
    scorer = Scorer(model.inference_forward, model.running_mode, model.dlm_config.mask_token_id, device,
                    batch_size=batch_size or args.batch_size, mc_num=args.mc_num, pattern=model.trained_pattern(),
                    select=select, dedupe=dedupe)
    pairs = [(context, continuation) for context, options in items for continuation in options]
    seeds = [pair_seed(args.seed, context) for context, _ in pairs]
    _synchronize(device)
    start = time.perf_counter()
    scores = scorer.score(pairs, seeds)
    _synchronize(device)
    return time.perf_counter() - start, [score for score, _ in scores]


def time_loop(model: GPTModel, items: list, args, device: torch.device) -> tuple:
    scores = []
    _synchronize(device)
    start = time.perf_counter()
    for context, options in items:
        for continuation in options:
            generator = torch.Generator().manual_seed(pair_seed(args.seed, context))
            scores.append(model.log_likelihood(torch.tensor(context, device=device),
                                               torch.tensor(continuation, device=device), mc_num=args.mc_num,
                                               batch_size=args.loop_batch_size, generator=generator))
    _synchronize(device)
    return time.perf_counter() - start, scores


def timed(function, items: list, repeats: int) -> dict:
    """`function` over each of `repeats` parts of `items`: total and median questions/s, the scores."""
    seconds, rates, scores = 0.0, [], []
    for part in _chunks(items, repeats):
        spent, part_scores = function(part)
        seconds, scores = seconds + spent, scores + part_scores
        rates.append(len(part) / spent)
    return {"questions": len(items), "seconds": seconds, "questions_per_s": len(items) / seconds,
            "median_questions_per_s": statistics.median(rates), "parts_questions_per_s": rates, "scores": scores}


def padding(items: list, args) -> dict:
    """Padded fraction of the batched scorer's row slots, its length-sorted order against the
    questions' own order (what sorting saves; no device needed)."""
    lengths = [len(context) + len(continuation) for context, options in items for continuation in options]

    def wasted(order: list) -> float:
        rows = [length for length in order for _ in range(args.mc_num)]
        batches = [rows[start:start + args.batch_size] for start in range(0, len(rows), args.batch_size)]
        slots = sum(max(batch) * len(batch) for batch in batches)
        return 1.0 - sum(rows) / slots

    return {"sorted": wasted(sorted(lengths, reverse=True)), "unsorted": wasted(lengths)}


def distinct_tokens(items: list, args) -> float:
    """The fraction of the mc_num copies' row tokens left once a pair's equal masks run once
    (the scorer's own draws, counted on the host)."""
    scorer = Scorer(None, "difflm-noshift", 0, torch.device("cpu"), mc_num=args.mc_num)
    kept = total = 0
    for context, options in items:
        for continuation in options:
            generator = torch.Generator().manual_seed(pair_seed(args.seed, context))
            masked = draw_masks(len(continuation), args.mc_num, generator)[1]
            width = len(context) + len(continuation)
            kept, total = kept + width * len(scorer._distinct(masked)), total + width * args.mc_num
    return kept / total


def levers(model: GPTModel, items: list, args, device: torch.device) -> dict:
    """The levers on the first --lever-questions questions, each against ours on the same ones."""
    subset = items[:args.lever_questions]
    base, _ = time_batched(model, subset, args, device)
    full, _ = time_batched(model, subset, args, device, select=False)
    double, _ = time_batched(model, subset, args, device, batch_size=2 * args.batch_size)
    every, _ = time_batched(model, subset, args, device, dedupe=False)
    return {"questions": len(subset), "select_seconds": base, "full_logits_seconds": full,
            "double_batch_seconds": double, "select_speedup": full / base, "double_batch_speedup": base / double,
            "every_copy_seconds": every, "dedupe_speedup": every / base}


def profile(model: GPTModel, items: list, args, device: torch.device) -> str:
    """The kernels of the batched scorer on two questions, by device time (where a forward goes)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        time_batched(model, items[:2], args, device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=args.profile)


def report(result: dict, args) -> str:
    ours, loop = result["batched"], result["loop"]
    lines = ["| scorer | rows / forward | questions | seconds | questions/s | median questions/s |",
             "|---|---|---|---|---|---|",
             f"| batched (ours) | {args.batch_size} | {ours['questions']} | {ours['seconds']:.2f} | "
             f"{ours['questions_per_s']:.3f} | {ours['median_questions_per_s']:.3f} |",
             f"| one pair at a time (LLaDA) | {args.loop_batch_size} | {loop['questions']} | {loop['seconds']:.2f} | "
             f"{loop['questions_per_s']:.3f} | {loop['median_questions_per_s']:.3f} |",
             f"speedup {result['speedup']:.2f}x (medians {result['median_speedup']:.2f}x); the two Monte Carlo "
             f"estimates differ by {result['relative_difference_of_the_estimates']:.1%} (other draws); padded "
             f"slots {result['padding']['sorted']:.2%} sorted, {result['padding']['unsorted']:.2%} unsorted; "
             f"distinct masked copies keep {result['distinct_tokens']:.1%} of the row tokens"]
    if "levers" in result:
        lever = result["levers"]
        lines.append(f"levers on {lever['questions']} questions: output layer at the scored slots only "
                     f"{lever['select_speedup']:.2f}x ({lever['full_logits_seconds']:.2f} s -> "
                     f"{lever['select_seconds']:.2f} s); batch {2 * args.batch_size} instead of {args.batch_size} "
                     f"{lever['double_batch_speedup']:.2f}x ({lever['double_batch_seconds']:.2f} s); equal masked "
                     f"copies once {lever['dedupe_speedup']:.2f}x (every copy {lever['every_copy_seconds']:.2f} s)")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(shapes.MODELS))
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--answer-tokens", type=int, nargs=2, default=(1, 16), metavar=("MIN", "MAX"))
    parser.add_argument("--mc-num", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=256, help="Rows per forward of the batched scorer.")
    parser.add_argument("--loop-batch-size", type=int, default=8, help="Rows per forward of the per-pair loop.")
    parser.add_argument("--loop-questions", type=int, help="Time the loop on the first N questions only.")
    parser.add_argument("--repeats", type=int, default=1,
                        help="Time each scorer on this many consecutive parts of its questions (the median).")
    parser.add_argument("--lever-questions", type=int, default=0,
                        help="Also time, on the first N questions, the full-logits scorer, twice the batch size "
                             "and every copy run.")
    parser.add_argument("--profile", type=int, default=0, help="Print the N costliest kernels of two questions.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-compile", action="store_true",
                        help="torch.compile each transformer layer (dynamic shapes), for both scorers.")
    parser.add_argument("--json", help="Also write the results here.")
    args = parser.parse_args(argv)
    for name in ("questions", "choices", "mc_num", "batch_size", "loop_batch_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, device, args.seed)
    if args.torch_compile:  # row lengths change from batch to batch: dynamic shapes, no recompile per length
        compile_transformer_layers(model, dynamic=True)
    items = questions(args.questions, args.choices, shapes.MODELS[args.model].vocab_size, tuple(args.context_tokens),
                      tuple(args.answer_tokens), args.seed)
    time_batched(model, items[:2], args, device)  # warm-up: kernels, allocator and (compiled) shapes
    time_batched(model, items[:2], args, device, select=False)
    time_loop(model, items[:2], args, device)
    if args.profile:
        print(profile(model, items, args, device))
    ours = timed(lambda part: time_batched(model, part, args, device), items, args.repeats)
    loop_items = items[:args.loop_questions or len(items)]
    loop = timed(lambda part: time_loop(model, part, args, device), loop_items, args.repeats)
    batched, looped = ours.pop("scores"), loop.pop("scores")
    # The same estimator with other draws (the loop stratifies within each of its batches): not equal.
    spread = sum(abs(a - b) for a, b in zip(batched, looped)) / max(sum(abs(b) for b in looped), 1e-9)
    result = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "mc_num": args.mc_num, "choices": args.choices,
              "torch_compile": args.torch_compile,
              "batched": {"batch_size": args.batch_size, **ours}, "loop": {"batch_size": args.loop_batch_size, **loop},
              "speedup": ours["questions_per_s"] / loop["questions_per_s"],
              "median_speedup": ours["median_questions_per_s"] / loop["median_questions_per_s"],
              "relative_difference_of_the_estimates": spread, "padding": padding(items, args),
              "distinct_tokens": distinct_tokens(items, args)}
    if args.lever_questions:
        result["levers"] = levers(model, items, args, device)
    print(report(result, args))
    if args.json:
        shapes.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
