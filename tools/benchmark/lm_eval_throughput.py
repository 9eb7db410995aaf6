"""Multiple-choice scoring throughput: our batched scorer against one question at a time.

lm-eval hands the model every (context, continuation) pair of a task at once. LLaDA's adapter
scores them one by one: for each pair, `mc_num` masked copies, `batch_size` copies per forward
(its commands: mc_num 128, batch 8). Ours (megatron/evaluation/scoring.py, what the `megadlms`
lm-eval model runs) streams the copies of all pairs, sorted by length, in batches of
`--batch-size` rows. Both compute the same estimate; this times them on the same synthetic
questions (random token ids, random weights: throughput only) and prints questions/s.

    python tools/benchmark/lm_eval_throughput.py --model qwen3-1.7b --questions 200 --choices 4 \\
        --mc-num 128 --loop-batch-size 8 --batch-size 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_throughput as shapes  # noqa: E402  (the named model shapes, shared with the training benchmark)

from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
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


def time_batched(model: GPTModel, items: list, args, device: torch.device) -> tuple:
    scorer = Scorer(model.inference_forward, model.running_mode, model.dlm_config.mask_token_id, device,
                    batch_size=args.batch_size, mc_num=args.mc_num, pattern=model._trained_pattern())
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


def main(argv=None) -> dict:
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="Also write the results here.")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, device, args.seed)
    items = questions(args.questions, args.choices, shapes.MODELS[args.model].vocab_size, tuple(args.context_tokens),
                      tuple(args.answer_tokens), args.seed)
    time_batched(model, items[:2], args, device)  # warm-up: kernels and allocator
    batched_s, batched = time_batched(model, items, args, device)
    loop_items = items[:args.loop_questions or len(items)]
    loop_s, looped = time_loop(model, loop_items, args, device)
    # The same estimator with other draws (the loop stratifies within each of its batches): not equal.
    spread = sum(abs(a - b) for a, b in zip(batched, looped)) / max(sum(abs(b) for b in looped), 1e-9)
    result = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "mc_num": args.mc_num, "choices": args.choices,
              "batched": {"batch_size": args.batch_size, "questions": len(items), "seconds": batched_s,
                          "questions_per_s": len(items) / batched_s},
              "loop": {"batch_size": args.loop_batch_size, "questions": len(loop_items), "seconds": loop_s,
                       "questions_per_s": len(loop_items) / loop_s},
              "relative_difference_of_the_estimates": spread}
    result["speedup"] = result["batched"]["questions_per_s"] / result["loop"]["questions_per_s"]
    print(f"| scorer | rows / forward | questions | seconds | questions/s |\n|---|---|---|---|---|\n"
          f"| batched (ours) | {args.batch_size} | {len(items)} | {batched_s:.2f} | "
          f"{result['batched']['questions_per_s']:.2f} |\n"
          f"| one pair at a time (LLaDA) | {args.loop_batch_size} | {len(loop_items)} | {loop_s:.2f} | "
          f"{result['loop']['questions_per_s']:.2f} |\n"
          f"speedup {result['speedup']:.2f}x; the two Monte Carlo estimates differ by {spread:.1%} (other draws)")
    if args.json:
        with open(args.json + ".tmp", "w") as handle:
            json.dump(result, handle, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return result


if __name__ == "__main__":
    main()
