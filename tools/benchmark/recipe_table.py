"""One row of dlm_recipes.sh's table: an arm's adaptation figures (from its training log) and its verse-task
decoding figures (from generation_throughput.py's JSON).

    python tools/benchmark/recipe_table.py --arm joint --adapt-log adapt.log --generation gen.json \
        [--ar-loss-weight 1.0] [--header]

Columns: validation ELBO (nats per token: the last validation's diffusion term, `diffusion loss value`,
or `lm loss value` when the loss has one term), AR perplexity (exp of the next-token term over its weight;
joint arms only), then on the held-out verse prompts: exact match and generated tokens per forward of
one-token-per-step decoding (the baseline), the threshold variant with the most tokens per forward whose
exact match is within `--tolerance` (1 point) of the baseline's, its speed-up over the baseline, and the
exact match of the same weights decoding autoregressively (joint arms).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Dict, List, Optional

VALIDATION = re.compile(r"validation loss at iteration \d+ \|(.*)$")


def validation_values(log_text: str) -> Dict[str, float]:
    """{name: value} of the last validation line (`lm loss value`, and each term's `<name> value`)."""
    lines = [match.group(1) for match in map(VALIDATION.search, log_text.splitlines()) if match]
    if not lines:
        raise ValueError("the adaptation log holds no validation line; was --eval-iters 0?")
    values = {}
    for part in lines[-1].split("|"):
        name, _, value = part.strip().rpartition(" value: ")
        if name:
            values[name] = float(value)
    return values


def elbo_and_ar_perplexity(values: Dict[str, float], ar_weight: float) -> tuple:
    elbo = values.get("diffusion loss", values["lm loss"])
    ar = values.get("ar loss")
    return elbo, (math.exp(ar / ar_weight) if ar is not None else None)


def decoding_figures(rows: List[dict], tolerance: float) -> dict:
    """The baseline's exact match and tokens per forward, the fastest threshold at equal accuracy, AR's."""
    baseline = next(row for row in rows if row["variant"] == "baseline")
    equal = [row for row in rows if row["threshold"] is not None
             and row["exact_match"] >= baseline["exact_match"] - tolerance]
    best = max(equal, key=lambda row: row["generated_tokens_per_forward"], default=None)
    ar = next((row for row in rows if row["variant"] == "ar"), None)
    return {"exact": baseline["exact_match"], "per_forward": baseline["generated_tokens_per_forward"],
            "best": best, "ar_exact": ar["exact_match"] if ar else None}


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table_row(arm: str, log_text: str, generation: dict, ar_weight: float, tolerance: float) -> str:
    elbo, ar_ppl = elbo_and_ar_perplexity(validation_values(log_text), ar_weight)
    figures = decoding_figures(generation["rows"], tolerance)
    best = figures["best"]
    threshold = ("-" if best is None else f"{best['threshold']:g}: {_percent(best['exact_match'])}, "
                 f"{best['generated_tokens_per_forward']:.2f} tok/fwd, {best['speedup_vs_baseline']:.2f}x")
    return (f"| {arm} | {elbo:.4f} | {'-' if ar_ppl is None else f'{ar_ppl:.2f}'} | {_percent(figures['exact'])}, "
            f"{figures['per_forward']:.2f} tok/fwd | {threshold} | {_percent(figures['ar_exact'])} |")


HEADER = ("| arm | validation ELBO (nats/token) | AR ppl | verse exact, one token a step | threshold at equal "
          "accuracy: exact, tokens/forward, speed-up | AR decoding exact |\n|---|---|---|---|---|---|")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", required=True)
    parser.add_argument("--adapt-log", required=True, help="The adaptation's training log.")
    parser.add_argument("--generation", required=True, help="generation_throughput.py --json of the SFT model.")
    parser.add_argument("--ar-loss-weight", type=float, default=1.0, help="The joint arms' --difflm-ar-loss-weight.")
    parser.add_argument("--tolerance", type=float, default=0.01, help="Equal accuracy: within this exact match.")
    parser.add_argument("--header", action="store_true", help="Print the table's header first.")
    args = parser.parse_args(argv)
    try:
        with open(args.adapt_log) as log, open(args.generation) as generation:
            row = table_row(args.arm, log.read(), json.load(generation), args.ar_loss_weight, args.tolerance)
    except (OSError, ValueError, KeyError, StopIteration) as error:
        print(f"error: {args.arm}: {error!r}", file=sys.stderr)
        return 1
    if args.header:
        print(HEADER)
    print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
