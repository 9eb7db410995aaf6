"""tools/benchmark/recipe_table.py: the figures of dlm_recipes.sh's table, read from a training log and a
generation_throughput.py JSON."""

import math

import pytest

from tools.benchmark import recipe_table

LOG = """ [2026-12-06] iteration 10/ 20 | lm loss: 1.2E+01 |
 validation loss at iteration 10 | lm loss value: 9.000000E+00 | lm loss PPL: 8.1E+03 |
 validation loss at iteration 20 | lm loss value: 1.166841E+01 | lm loss PPL: 1.168220E+05 | diffusion loss value: \
7.475870E+00 | ar loss value: 4.192536E+00 |
"""


def row(variant, threshold, exact, per_forward, speedup=1.0):
    return {"variant": variant, "threshold": threshold, "exact_match": exact,
            "generated_tokens_per_forward": per_forward, "speedup_vs_baseline": speedup}


def test_the_last_validation_gives_the_diffusion_term_and_the_ar_perplexity():
    values = recipe_table.validation_values(LOG)
    assert values["diffusion loss"] == 7.475870 and values["ar loss"] == 4.192536
    elbo, ar_ppl = recipe_table.elbo_and_ar_perplexity(values, ar_weight=2.0)
    assert elbo == 7.475870 and ar_ppl == pytest.approx(math.exp(4.192536 / 2.0))
    plain = recipe_table.validation_values(LOG.split(" validation loss at iteration 20")[0])
    assert recipe_table.elbo_and_ar_perplexity(plain, 1.0) == (9.0, None)
    with pytest.raises(ValueError, match="no validation line"):
        recipe_table.validation_values("iteration 1 | lm loss: 1 |")


def test_the_fastest_threshold_within_the_tolerance_of_the_baselines_accuracy():
    rows = [row("baseline", None, 0.50, 1.0), row("threshold", 0.9, 0.50, 2.0, 1.8),
            row("threshold", 0.7, 0.495, 3.0, 2.6), row("threshold", 0.5, 0.40, 6.0, 5.0), row("ar", None, 0.6, 1.0)]
    figures = recipe_table.decoding_figures(rows, tolerance=0.01)
    assert figures["best"]["threshold"] == 0.7 and figures["exact"] == 0.5 and figures["ar_exact"] == 0.6
    line = recipe_table.table_row("joint", LOG, {"rows": rows}, 1.0, 0.01)
    assert line.startswith("| joint | 7.4759 | 66.19 | 50.0%, 1.00 tok/fwd | 0.7: 49.5%, 3.00 tok/fwd, 2.60x | 60.0% |")
