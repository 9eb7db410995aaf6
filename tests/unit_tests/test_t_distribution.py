"""Non-uniform noise levels (--difflm-t-distribution): the quantiles and densities against closed forms
written out here, the importance weight that keeps the loss an ELBO estimate over uniform t (and its
absence, the surrogate), per row, per block and per document, and the flags."""

import math

import pytest
import torch

from custom_args.difflm import add_difflm_args
from megatron.core.models.difflm import diffusion, t_distribution
from megatron.core.models.difflm.diffusion import CorruptionKey
from megatron.core.transformer.transformer_config import DLMConfig
from megatron.training.arguments import parse_args
from tests.unit_tests.test_training import TINY

MASK = 99


def dlm(**changes) -> DLMConfig:
    return DLMConfig(**{"mask_token_id": MASK, **changes}).validate()


def bisect(cdf, u: float) -> float:
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < u else (low, middle)
    return (low + high) / 2


def logit_normal_cdf(m: float, s: float):
    def cdf(t: float) -> float:
        return 0.5 * (1 + math.erf((math.log(t / (1 - t)) - m) / (s * math.sqrt(2)))) if 0 < t < 1 else float(t >= 1)
    return cdf


# Beta CDFs with integer parameters, as polynomials: I_t(2, 2) = 3t^2 - 2t^3, I_t(3, 2) = 4t^3 - 3t^4.
BETA_CDF = {(2.0, 2.0): lambda t: 3 * t ** 2 - 2 * t ** 3, (3.0, 2.0): lambda t: 4 * t ** 3 - 3 * t ** 4}
BETA_PDF = {(2.0, 2.0): lambda t: 6 * t * (1 - t), (3.0, 2.0): lambda t: 12 * t ** 2 * (1 - t)}


@pytest.mark.parametrize("mix", [0.0, 0.1])
@pytest.mark.parametrize("cfg,cdf", [
    (dict(t_distribution="logit_normal"), logit_normal_cdf(0.0, 1.0)),
    (dict(t_distribution="logit_normal", t_logit_normal_mean=0.7, t_logit_normal_std=0.5), logit_normal_cdf(0.7, 0.5)),
    (dict(t_distribution="beta"), BETA_CDF[(2.0, 2.0)]),
    (dict(t_distribution="beta", t_beta_a=3.0, t_beta_b=2.0), BETA_CDF[(3.0, 2.0)]),
])
def test_the_quantile_inverts_the_mixtures_cdf(cfg, cdf, mix):
    u = torch.tensor([0.001, 0.05, 0.3, 0.5, 0.77, 0.999], dtype=torch.float64)
    expected = torch.tensor([bisect(lambda t: mix * t + (1 - mix) * cdf(t), value) for value in u.tolist()],
                            dtype=torch.float64)
    torch.testing.assert_close(t_distribution.quantile(dlm(**cfg, t_uniform_mix=mix), u), expected, rtol=0,
                               atol=1e-6)


def test_the_densities_are_the_closed_forms_mixed_with_uniform():
    s = torch.tensor([0.01, 0.2, 0.5, 0.9], dtype=torch.float64)
    for (a, b), pdf in BETA_PDF.items():
        expected = torch.tensor([0.25 + 0.75 * pdf(value) for value in s.tolist()], dtype=torch.float64)
        cfg = dlm(t_distribution="beta", t_beta_a=a, t_beta_b=b, t_uniform_mix=0.25)
        torch.testing.assert_close(t_distribution.density(cfg, s), expected)
    m, std = -0.3, 1.5
    cdf = logit_normal_cdf(m, std)
    numeric = torch.tensor([(cdf(v + 1e-6) - cdf(v - 1e-6)) / 2e-6 for v in s.tolist()], dtype=torch.float64)
    cfg = dlm(t_distribution="logit_normal", t_logit_normal_mean=m, t_logit_normal_std=std, t_uniform_mix=0.0)
    torch.testing.assert_close(t_distribution.density(cfg, s), numeric, rtol=1e-6, atol=0)
    assert torch.equal(t_distribution.density(dlm(), s), torch.ones_like(s))
    # The defensive mixture bounds the weight: 1 / q <= 1 / mix, also deep in a thin tail.
    tail = torch.tensor([1e-7, 1 - 1e-7], dtype=torch.float64)
    assert float(t_distribution.importance_weight(dlm(t_distribution="logit_normal"), tail).max()) <= 10.0


def _masked_fraction(cfg: DLMConfig, rows: int = 1024, seq: int = 32, iterations: int = 64) -> float:
    """The loss of batches whose every token costs 1, averaged over iterations: with loss_weight none, the
    expected masked fraction under uniform t when the weights keep the ELBO's integral. (Each iteration's
    antithetic offset is another draw: the average is over the offsets, which the estimate is unbiased over.)"""
    ids = torch.zeros(rows, seq, dtype=torch.int64)
    total = 0.0
    for iteration in range(iterations):
        key = CorruptionKey.for_batch(seed=5, iteration=iteration, global_batch_size=rows, first_sample_index=0,
                                      batch_size=rows)
        weights, normalizer = diffusion.loss_weights(diffusion.corrupt(ids, cfg, key), cfg)
        total += float(weights.sum() / normalizer)
    return total / iterations


@pytest.mark.parametrize("shape", [dict(t_distribution="beta", t_beta_a=3.0, t_beta_b=2.0),
                                   dict(t_distribution="logit_normal", t_logit_normal_mean=0.8)])
def test_importance_weights_keep_the_uniform_t_expectation_and_the_surrogate_does_not(shape):
    eps = 1e-3
    base = dict(loss_weight="none", t_sampling="antithetic", eps=eps, t_min=0.1, t_max=0.9)
    uniform = (1 - eps) * 0.5 + eps  # E[p] over t uniform on [0.1, 0.9)
    weighted = _masked_fraction(dlm(**base, **shape))
    surrogate_cfg = dlm(**base, **shape, t_importance_weight=False)
    surrogate = _masked_fraction(surrogate_cfg)
    assert abs(weighted - uniform) < 0.005, (weighted, uniform)
    if shape["t_distribution"] == "beta":
        shape_mean = 0.6
    else:  # E[s] as the mean of the quantiles at 2000 midpoints of u, each by bisection of the CDF
        cdf = logit_normal_cdf(0.8, 1.0)
        shape_mean = sum(bisect(cdf, (k + 0.5) / 2000) for k in range(2000)) / 2000
    mean_t = 0.1 + 0.8 * (0.1 / 2 + 0.9 * shape_mean)  # the default uniform share 0.1
    assert abs(surrogate - ((1 - eps) * mean_t + eps)) < 0.005, (surrogate, mean_t)
    assert abs(surrogate - uniform) > 0.03  # the surrogate is another objective
    assert abs(diffusion.expected_mask_probability(surrogate_cfg) - ((1 - eps) * mean_t + eps)) < 1e-5


def test_block_and_document_t_follow_the_distribution_and_a_given_t_is_not_reweighted():
    cfg = dlm(t_distribution="beta", t_beta_a=3.0, t_beta_b=2.0, t_uniform_mix=0.0, block_diffusion=True,
              block_size=4)
    key = CorruptionKey.for_batch(seed=1, iteration=0, global_batch_size=512, first_sample_index=0, batch_size=512)
    block_t = diffusion.sample_block_t(cfg, key, 64)
    assert abs(float(block_t.mean()) - 0.6) < 0.01  # beta(3, 2)'s mean, not uniform's 0.5
    assert abs(float(block_t.var()) - 0.04) < 0.004  # a b / ((a + b)^2 (a + b + 1)) = 6 / 150
    document = dlm(t_distribution="beta", t_beta_a=3.0, t_beta_b=2.0, t_uniform_mix=0.0, per_document_t=True)
    ids = torch.zeros(512, 16, dtype=torch.int64)
    documents = torch.arange(16).div(4, rounding_mode="floor").expand(512, 16)
    corruption = diffusion.corrupt(ids, document, key, document_ids=documents)
    t = (corruption.p_mask.double() - document.eps) / (1 - document.eps)
    assert abs(float(t.mean()) - 0.6) < 0.01
    torch.testing.assert_close(corruption.t_weight, t_distribution.importance_weight(document, t), rtol=1e-5, atol=0)
    fixed = diffusion.corrupt(ids, document, key, t=torch.full((512,), 0.5, dtype=torch.float64))
    assert fixed.t_weight is None


def test_the_flags_build_the_distribution_and_refuse_what_needs_another(capsys):
    args = parse_args(TINY + ["--train-iters", "1", "--difflm-t-distribution", "beta", "--difflm-t-beta", "3", "2",
                              "--difflm-t-no-importance-weight"], add_difflm_args, world_size=1)
    cfg = args.dlm_config
    assert (cfg.t_distribution, cfg.t_beta_a, cfg.t_beta_b, cfg.t_importance_weight) == ("beta", 3.0, 2.0, False)
    for flags, message in ((["--difflm-t-beta", "3", "2"], "--difflm-t-distribution beta"),
                           (["--difflm-t-distribution", "beta", "--difflm-t-beta", "0.5", "2"], "t_beta_a=0.5"),
                           (["--difflm-t-distribution", "logit_normal", "--difflm-t-logit-normal-std", "0"],
                            "t_logit_normal_std=0.0")):
        with pytest.raises(SystemExit):
            parse_args(TINY + ["--train-iters", "1"] + flags, add_difflm_args, world_size=1)
        assert message in capsys.readouterr().err
