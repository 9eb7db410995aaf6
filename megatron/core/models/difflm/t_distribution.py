"""The distribution of the noise level t: uniform (MDLM, LLaDA), logit-normal, or a bell-shaped beta.

A draw is u in [0, 1) (keyed, diffusion.py; stratified over the batch under antithetic sampling)
mapped through the distribution's quantile function, then into [t_min, t_max). The quantile keeps
antithetic stratification: strata of u become equal-probability strata of t.

The masked-diffusion ELBO integrates the weighted loss over t uniform on [0, 1] (on [t_min, t_max]
under clipping). Drawing t from a density q instead estimates the same integral when each draw's
loss is multiplied by 1 / q(t) (importance sampling, `importance_weight`). A pure bell has thin tails,
where 1 / q is huge: the estimate's variance is unbounded (logit-normal always, beta for a or b >= 2).
So q is a defensive mixture, q = mix + (1 - mix) q_shape with a uniform share `mix`
(DLMConfig.t_uniform_mix, default 0.1): the weight never exceeds 1 / mix. Without the weight
(DLMConfig.t_importance_weight False) the objective is a biased surrogate that spends more of the
training signal near q's mode, as logit-normal timestep sampling does in rectified-flow training;
its loss is then not an ELBO estimate.

- logit_normal(m, s): logit(t) ~ N(m, s^2), CDF ndtr((logit(t) - m) / s).
- beta(a, b), a, b >= 1: density t^(a-1) (1-t)^(b-1) / B(a, b), its CDF integrated numerically.
The quantile of the mixture is read from its CDF, tabulated once per distribution in float64 on 2**16
intervals and inverted by linear interpolation (torch has no inverse incomplete beta function, and
the mixture has no closed-form quantile).
"""

from __future__ import annotations

import functools
import math

import torch

from megatron.core.transformer.transformer_config import T_DISTRIBUTIONS

# With mix = 0, u (a multiple of 2**-24, or an exact fraction under antithetic sampling) may be 0: the
# quantile reads it at least half a 24-bit step inside (0, 1), where the density is positive.
_U_MARGIN = 2.0 ** -25
_GRID = 1 << 16


def quantile(cfg, u: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) (float64) -> s in [0, 1) distributed as cfg.t_distribution; identity for uniform."""
    if cfg.t_distribution == "uniform":
        return u
    grid, cdf = _cdf_table(*_shape(cfg), float(cfg.t_uniform_mix))
    u = u.clamp(_U_MARGIN, 1.0 - _U_MARGIN)
    return _interpolate(u, cdf.to(u.device), grid.to(u.device))


def density(cfg, s: torch.Tensor) -> torch.Tensor:
    """q(s), the density of s in (0, 1) (float64; 1 for uniform): mix + (1 - mix) q_shape(s)."""
    if cfg.t_distribution == "uniform":
        return torch.ones_like(s)
    return cfg.t_uniform_mix + (1.0 - cfg.t_uniform_mix) * _shape_density(*_shape(cfg), s)


def importance_weight(cfg, t: torch.Tensor) -> torch.Tensor:
    """1 / q(s) of noise levels t in [t_min, t_max) (s = their place in that range), float32: the factor
    that keeps the loss an unbiased ELBO estimate under a non-uniform t; at most 1 / t_uniform_mix."""
    s = (t.to(torch.float64) - cfg.t_min) / (cfg.t_max - cfg.t_min)
    return (1.0 / density(cfg, s)).to(torch.float32)


def mean(cfg) -> float:
    """E[s] of the distribution on [0, 1): mix / 2 + (1 - mix) E_shape[s] (uniform 1/2, beta a / (a + b),
    logit-normal by quadrature)."""
    if cfg.t_distribution == "uniform":
        return 0.5
    if cfg.t_distribution == "beta":
        shape_mean = cfg.t_beta_a / (cfg.t_beta_a + cfg.t_beta_b)
    else:
        s = (torch.arange(_GRID, dtype=torch.float64) + 0.5) / _GRID
        shape_mean = float((s * _shape_density(*_shape(cfg), s)).mean())
    return cfg.t_uniform_mix / 2.0 + (1.0 - cfg.t_uniform_mix) * shape_mean


def _shape(cfg) -> tuple:
    """(distribution, its two parameters): with the uniform share, the key of the tabulated CDF."""
    if cfg.t_distribution == "logit_normal":
        params = (float(cfg.t_logit_normal_mean), float(cfg.t_logit_normal_std))
    elif cfg.t_distribution == "beta":
        params = (float(cfg.t_beta_a), float(cfg.t_beta_b))
    else:
        raise ValueError(f"DLMConfig.t_distribution={cfg.t_distribution!r} is not one of {list(T_DISTRIBUTIONS)}")
    return (cfg.t_distribution, *params)


def _shape_density(kind: str, first: float, second: float, s: torch.Tensor) -> torch.Tensor:
    if kind == "logit_normal":
        z = (torch.logit(s) - first) / second
        return torch.exp(-0.5 * z * z) / (second * math.sqrt(2.0 * math.pi) * s * (1.0 - s))
    log_beta = math.lgamma(first) + math.lgamma(second) - math.lgamma(first + second)
    return torch.exp((first - 1.0) * torch.log(s) + (second - 1.0) * torch.log1p(-s) - log_beta)


@functools.lru_cache(maxsize=8)
def _cdf_table(kind: str, first: float, second: float, mix: float):
    """(grid, the mixture's CDF on it), 2**16 intervals of [0, 1]."""
    grid = torch.linspace(0.0, 1.0, _GRID + 1, dtype=torch.float64)
    inner = grid[1:-1]
    if kind == "logit_normal":
        shape_cdf = torch.cat([grid[:1], torch.special.ndtr((torch.logit(inner) - first) / second), grid[-1:]])
    else:  # trapezoid rule on the density, bounded for a, b >= 1, normalised to end at exactly 1
        pdf = torch.zeros_like(grid)
        pdf[1:-1] = _shape_density(kind, first, second, inner)
        # The ends: beta(1, b) starts at b = 1 / B(1, b), beta(a, 1) ends at a; a, b > 1 give 0 there.
        pdf[0], pdf[-1] = (second if first == 1.0 else 0.0), (first if second == 1.0 else 0.0)
        cumulative = torch.cumsum((pdf[1:] + pdf[:-1]) / (2 * _GRID), 0)
        shape_cdf = torch.cat([grid[:1], cumulative / cumulative[-1]])
    return grid, mix * grid + (1.0 - mix) * shape_cdf


def _interpolate(u: torch.Tensor, cdf: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """The inverse of the tabulated CDF at u, linear between grid points."""
    right = torch.searchsorted(cdf, u.contiguous()).clamp(1, cdf.numel() - 1)
    left = right - 1
    span = (cdf[right] - cdf[left]).clamp(min=torch.finfo(torch.float64).tiny)
    return grid[left] + (u - cdf[left]) / span * (grid[right] - grid[left])
