"""The masked-diffusion forward process: noise levels, token masks and loss weights.

Why a hash and not a torch.Generator: the corruption of a sample must be a pure function of
(seed, stream, the sample's global index, token position) so that every tensor-, pipeline-,
context- and data-parallel rank derives the same mask without communication, a resumed run
reproduces it exactly, and DP=2 equals one process with gradient accumulation mask for mask
(shared/DESIGN.md section 3). Generator state depends on how many draws happened before on
that rank, i.e. on the layout; a counter-based hash does not.

The hash works on 32-bit words held in int64 tensors. Every intermediate stays below 2**49,
so it is exact on CPU and CUDA alike (no signed overflow, no float rounding) and masks are
bit-identical across devices. Each word is absorbed as h <- mix(h ^ word), where mix is a
xor-shift/multiply finaliser (constants of the "lowbias32" family); 64-bit values are split
into two words. Uniforms are the top 24 bits of the hash as float32 k / 2**24, exact in [0, 1).

Every internal draw prepends a purpose tag to its indices, so e.g. the per-row t and the
per-token mask uniform never share a hash input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.models.difflm import t_distribution
from megatron.core.transformer.transformer_config import DLMConfig

__all__ = ["CorruptionKey", "Corruption", "keyed_bits", "keyed_uniform", "sample_t", "sample_block_t",
           "mask_probability", "expected_mask_probability", "corrupt", "loss_weights", "varilen_length"]

_M32 = 0xFFFFFFFF
_IV = 0x243F6A88                      # initial state; any fixed constant works
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B
_U24 = 2.0 ** -24

# Purpose tags (first index of every internal draw).
_TAG_MASK, _TAG_ROW_T, _TAG_DOC_T, _TAG_ANTITHETIC, _TAG_VARILEN_COIN, _TAG_VARILEN_LEN, _TAG_BLOCK_T = range(1, 8)

IntOrTensor = Union[int, torch.Tensor]


def _mul32(x: IntOrTensor, c: int) -> IntOrTensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, with no product above 2**48 (int64-safe)."""
    if isinstance(x, int):
        return (x * c) & _M32
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix(h: IntOrTensor) -> IntOrTensor:
    """Bijective avalanche on one 32-bit word (xor-shift, multiply, xor-shift, multiply, xor-shift)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _MUL1)
    h = h ^ (h >> 15)
    h = _mul32(h, _MUL2)
    return h ^ (h >> 16)


def _absorb64(h: IntOrTensor, value: IntOrTensor) -> IntOrTensor:
    """Absorb a 64-bit (two's complement) value as its low then high 32-bit word."""
    h = _mix(h ^ (value & _M32))
    return _mix(h ^ ((value >> 32) & _M32))


def keyed_bits(seed: int, stream: int, *indices: IntOrTensor) -> IntOrTensor:
    """32-bit hash of (seed, stream, number of indices, indices...) as int64 values in [0, 2**32).

    Indices are python ints or integer tensors (broadcast together). Scalar arguments are
    hashed in python so only the index words touch tensors; with python-int indices only, the
    result is a python int (used for batch-level decisions that need no device).
    """
    h = _absorb64(_absorb64(_IV, int(seed)), int(stream))
    h = _mix(h ^ len(indices))
    for pos, index in enumerate(indices):
        if isinstance(index, torch.Tensor):
            if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
                raise ValueError(f"keyed_bits: indices[{pos}] has dtype {index.dtype}; pass integer tensors")
            index = index.to(torch.int64)
        elif not isinstance(index, int):
            raise ValueError(f"keyed_bits: indices[{pos}] is {type(index).__name__}; pass ints or tensors")
        h = _absorb64(h, index)
    return h


def keyed_uniform(seed: int, stream: int, *indices: IntOrTensor) -> torch.Tensor:
    """Float32 uniforms in [0, 1) (multiples of 2**-24), a pure function of the arguments.

    float32 because 24 bits is exactly its mantissa: k / 2**24 is represented without rounding.
    """
    bits = keyed_bits(seed, stream, *indices)
    if isinstance(bits, int):
        return torch.tensor((bits >> 8) * _U24, dtype=torch.float32)
    return (bits >> 8).to(torch.float32) * _U24


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields cannot be compared with ==
class CorruptionKey:
    """Where each row of a batch sits in its stream: everything the corruption is keyed on.

    The seed here, not DLMConfig.seed, keys masks and t (the training loop builds keys from
    DLMConfig.seed; varilen_length, which has no key, reads DLMConfig.seed).
    Training: stream=0, sample_index = consumed samples + offset of the row, batch_position =
    position of the row within the global batch. Evaluation: stream=1 (or higher), iteration=0
    and sample_index = index within the validation set, so every evaluation draws the same masks.
    """

    seed: int
    sample_index: torch.Tensor
    batch_position: torch.Tensor
    global_batch_size: int
    iteration: int
    stream: int = 0

    def __post_init__(self) -> None:
        for name in ("sample_index", "batch_position"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
                raise ValueError(f"CorruptionKey.{name} must be a 1-D int64 tensor, got "
                                 f"{getattr(value, 'dtype', type(value).__name__)} "
                                 f"with shape {tuple(getattr(value, 'shape', ()))}")
        if self.sample_index.shape != self.batch_position.shape:
            raise ValueError(f"CorruptionKey.batch_position has shape {tuple(self.batch_position.shape)} but "
                             f"sample_index has {tuple(self.sample_index.shape)}; give one entry per row")
        if self.global_batch_size < 1:
            raise ValueError(f"CorruptionKey.global_batch_size={self.global_batch_size} must be >= 1")

    @property
    def num_rows(self) -> int:
        return self.sample_index.shape[0]

    @staticmethod
    def for_batch(seed: int, iteration: int, global_batch_size: int, first_sample_index: int,
                  batch_size: int, first_batch_position: int = 0, stream: int = 0,
                  device=None) -> "CorruptionKey":
        """Key of `batch_size` consecutive rows (a micro-batch on one DP rank, say)."""
        if batch_size < 0:
            raise ValueError(f"CorruptionKey.for_batch: batch_size={batch_size} must be >= 0")
        if first_batch_position < 0 or first_batch_position + batch_size > global_batch_size:
            raise ValueError(f"CorruptionKey.for_batch: batch_position range [{first_batch_position}, "
                             f"{first_batch_position + batch_size}) exceeds global_batch_size={global_batch_size}")
        rows = torch.arange(batch_size, dtype=torch.int64, device=device)
        return CorruptionKey(seed=seed, sample_index=rows + first_sample_index,
                             batch_position=rows + first_batch_position,
                             global_batch_size=global_batch_size, iteration=iteration, stream=stream)

    def narrow(self, start: int, length: int) -> "CorruptionKey":
        """Key of rows [start, start + length): splitting a batch keeps every row's mask."""
        return CorruptionKey(self.seed, self.sample_index.narrow(0, start, length),
                             self.batch_position.narrow(0, start, length),
                             self.global_batch_size, self.iteration, self.stream)


def _t_range(cfg: DLMConfig, u: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) -> t in [t_min, t_max), distributed as cfg.t_distribution (t_distribution.py): the
    identity (no op at all) for the default uniform t on [0, 1)."""
    u = t_distribution.quantile(cfg, u)
    if cfg.t_min == 0.0 and cfg.t_max == 1.0:
        return u
    return u * (cfg.t_max - cfg.t_min) + cfg.t_min


def sample_t(cfg: DLMConfig, key: CorruptionKey, device=None) -> torch.Tensor:
    """Noise level per row, float64 [b] in [t_min, t_max) (default [0, 1)).

    uniform: t keyed by (key.seed, stream, sample_index), independent of the batch layout.
    antithetic: t_i = frac(u0 + batch_position_i / n), u0 keyed by (seed, stream, iteration),
    so the n rows of a global batch hit each stratum [k/n, (k+1)/n) exactly once (lower
    variance of the loss estimate, as in MDLM). Computed as an exact integer fraction
    ((k0 * n + pos * 2**24) mod (n * 2**24)) / (n * 2**24), hence float64: float32 could round
    a value across a stratum boundary.
    """
    if cfg.t_sampling == "uniform":
        index = key.sample_index.to(device)
        return _t_range(cfg, keyed_uniform(key.seed, key.stream, _TAG_ROW_T, index).to(torch.float64))
    if cfg.t_sampling == "antithetic":
        n = key.global_batch_size
        k0 = keyed_bits(key.seed, key.stream, _TAG_ANTITHETIC, int(key.iteration)) >> 8
        denom = n << 24
        numer = torch.remainder(key.batch_position.to(device) * (1 << 24) + k0 * n, denom)
        return _t_range(cfg, numer.to(torch.float64) / float(denom))
    raise ValueError(f"DLMConfig.t_sampling={cfg.t_sampling!r} is not one of ['uniform', 'antithetic']")


def sample_block_t(cfg: DLMConfig, key: CorruptionKey, seq_length: int, device=None) -> torch.Tensor:
    """Block diffusion's noise level per (row, block), float64 [b, seq_length // block_size].

    uniform: keyed by (seed, stream, sample_index, block). antithetic: stratified over the grid of
    the global batch's rows x blocks (BD3-LM): cell c = batch_position * blocks + block gets
    frac(u0 + c / (n * blocks)), computed as an exact integer fraction like sample_t.
    """
    blocks = seq_length // cfg.block_size
    block = torch.arange(blocks, dtype=torch.int64, device=device)[None, :]
    if cfg.t_sampling == "uniform":
        index = key.sample_index.to(device)[:, None]
        return _t_range(cfg, keyed_uniform(key.seed, key.stream, _TAG_BLOCK_T, index, block).to(torch.float64))
    if cfg.t_sampling == "antithetic":
        cells = key.global_batch_size * blocks
        k0 = keyed_bits(key.seed, key.stream, _TAG_ANTITHETIC, int(key.iteration)) >> 8
        cell = key.batch_position.to(device)[:, None] * blocks + block
        numer = torch.remainder(cell * (1 << 24) + k0 * cells, cells << 24)
        return _t_range(cfg, numer.to(torch.float64) / float(cells << 24))
    raise ValueError(f"DLMConfig.t_sampling={cfg.t_sampling!r} is not one of ['uniform', 'antithetic']")


def mask_probability(cfg: DLMConfig, t: torch.Tensor) -> torch.Tensor:
    """p = (1 - eps) * t + eps (LLaDA), in t's dtype; eps keeps every sequence trainable.

    Two separate ops on purpose: a fused multiply-add could round differently on another device.
    """
    return t * (1.0 - cfg.eps) + cfg.eps


def expected_mask_probability(cfg: DLMConfig) -> float:
    """E[p], the expected fraction of maskable positions masked: (1 - eps) E[t] + eps, with
    E[t] = (t_min + t_max) / 2 for uniform t. Every way of drawing t gives each row (block, document) a t that is
    distributed on [t_min, t_max) as cfg.t_distribution says on its own (antithetic sampling stratifies
    the batch, not the marginal), so the expectation is the same for all: E[t] = t_min + (t_max - t_min) E[s]
    (t_distribution.mean, 1/2 for uniform t). Not counted: inverse_empirical's one forced mask in a row
    that drew none (over t in [0, 1) a row of n positions draws none with probability (1 - eps)^n / (n + 1):
    4e-6 at n = 4096)."""
    mean_t = cfg.t_min + (cfg.t_max - cfg.t_min) * t_distribution.mean(cfg)
    return (1.0 - cfg.eps) * mean_t + cfg.eps


@dataclass
class Corruption:
    """Result of `corrupt`. `maskable` is the mask it was given (all True when None), kept so
    `loss_weights` can normalise by the same positions without the caller passing it again.
    `t_weight`: 1 / q(t) per position under a non-uniform, importance-weighted t (None otherwise)."""

    noisy_input_ids: torch.Tensor
    masked_positions: torch.Tensor
    p_mask: torch.Tensor
    maskable: Optional[torch.Tensor] = None
    t_weight: Optional[torch.Tensor] = None


def _check_corrupt_args(input_ids, cfg, key, maskable, document_ids, t) -> None:
    """ValueError naming the offending argument, before any work is done."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a 2-D torch.long tensor [batch, seq], got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"with shape {tuple(getattr(input_ids, 'shape', ()))}")
    shape = tuple(input_ids.shape)
    if cfg.mask_token_id is None:
        raise ValueError("cfg.mask_token_id is None; the diffusion objective needs a mask token id")
    if maskable is not None and (not isinstance(maskable, torch.Tensor) or maskable.dtype != torch.bool
                                 or tuple(maskable.shape) != shape):
        raise ValueError(f"maskable must be a bool tensor of shape {shape} like input_ids, got "
                         f"{maskable.dtype} with shape {tuple(maskable.shape)}")
    if document_ids is not None and (not isinstance(document_ids, torch.Tensor)
                                     or tuple(document_ids.shape) != shape or document_ids.dtype.is_floating_point
                                     or document_ids.dtype == torch.bool):
        raise ValueError(f"document_ids must be an integer tensor of shape {shape} like input_ids, got "
                         f"{document_ids.dtype} with shape {tuple(document_ids.shape)}")
    if not isinstance(key, CorruptionKey) or key.num_rows != shape[0]:
        rows = key.num_rows if isinstance(key, CorruptionKey) else type(key).__name__
        raise ValueError(f"key has {rows} rows but input_ids has {shape[0]}; build the key for this batch")
    if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape[:1]
                          or not t.dtype.is_floating_point):
        raise ValueError(f"t must be a floating tensor of shape {shape[:1]}, got {t.dtype} {tuple(t.shape)}")


def _force_one_mask(masked: torch.Tensor, maskable: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Mask the maskable position with the smallest hash in rows that drew no mask.

    Needed by inverse_empirical, whose weight is 1 / (masked fraction). The position is the one
    whose uniform was closest to passing; ties are broken by position so argmin is unambiguous.
    """
    seq = masked.shape[1]
    positions = torch.arange(seq, device=masked.device)
    score = torch.where(maskable, bits * seq + positions, torch.iinfo(torch.int64).max)
    chosen = torch.nn.functional.one_hot(score.argmin(dim=1), seq).bool()
    needs = maskable.any(dim=1, keepdim=True) & ~masked.any(dim=1, keepdim=True)
    return masked | (chosen & needs)


def corrupt(input_ids: torch.Tensor, cfg: DLMConfig, key: CorruptionKey,
            maskable: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
            *, t: Optional[torch.Tensor] = None) -> Corruption:
    """Mask tokens i.i.d.: position j of row i is masked iff u(seed, stream, i's sample index, j) < p.

    p comes from t per row (sample_t), per (row, block) with cfg.block_diffusion (sample_block_t;
    the sequence length must be a multiple of the block size), or per (row, document) with cfg.per_document_t and
    document_ids (keyed by the document id; antithetic stratification then does not apply to the
    documents). `t` ([b], keyword only) overrides the sampled per-row t, e.g. for evaluation at
    fixed noise levels. Positions with maskable False (padding, prompt) are never masked.
    """
    _check_corrupt_args(input_ids, cfg, key, maskable, document_ids, t)
    batch, seq = input_ids.shape
    device = input_ids.device
    if maskable is None:
        maskable = torch.ones(batch, seq, dtype=torch.bool, device=device)
    sample_index = key.sample_index.to(device)[:, None]
    if t is not None:
        t_tok = t.to(device=device, dtype=torch.float64)[:, None].expand(batch, seq)
    elif cfg.block_diffusion:
        t_tok = sample_block_t(cfg, key, seq, device).repeat_interleave(cfg.block_size, dim=1)
    elif cfg.per_document_t and document_ids is not None:
        doc = document_ids.to(device=device, dtype=torch.int64)
        t_tok = _t_range(cfg, keyed_uniform(key.seed, key.stream, _TAG_DOC_T, sample_index, doc).to(torch.float64))
    else:
        t_tok = sample_t(cfg, key, device)[:, None].expand(batch, seq)
    p = mask_probability(cfg, t_tok)
    positions = torch.arange(seq, dtype=torch.int64, device=device)[None, :]
    bits = keyed_bits(key.seed, key.stream, _TAG_MASK, sample_index, positions)
    uniform = (bits >> 8).to(torch.float32) * _U24
    masked = (uniform < p) & maskable          # compared in float64: exact for 24-bit uniforms
    if cfg.loss_weight == "inverse_empirical":
        masked = _force_one_mask(masked, maskable, bits)
    noisy = torch.where(masked, torch.full_like(input_ids, cfg.mask_token_id), input_ids)
    t_weight = None
    if t is None and cfg.t_distribution != "uniform" and cfg.t_importance_weight:
        t_weight = t_distribution.importance_weight(cfg, t_tok).contiguous()
    return Corruption(noisy, masked, p.to(torch.float32).contiguous(), maskable, t_weight)


def loss_weights(corruption: Corruption, cfg: DLMConfig, maskable: Optional[torch.Tensor] = None,
                 clamp_normalizer: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token weights [b, s] float32 and a normalizer (0-dim float32): loss = (ce * w).sum() / norm.

    Weights (zero at unmasked positions): inverse_p 1/p (1 under block diffusion with t_min > 0.5,
    as BD3-LM's clipped schedule does); inverse_empirical n_maskable / n_masked
    of the row (per row even with per-document t); none 1. Normalizers: tokens = maskable tokens
    (B*L without padding, LLaDA); masked = masked tokens; sequence = weights divided by each
    row's maskable count, normalizer = rows with a maskable token (mean over sequences). Under a
    non-uniform, importance-weighted t every weight is multiplied by the corruption's 1 / q(t).
    Sum and normalizer are returned apart so the training loop can sum both over micro-batches
    and DP ranks and divide once: accumulation then equals one big batch exactly. For that, pass
    clamp_normalizer=False and clamp the total; by default the normalizer is clamped to >= 1 so
    a batch without any maskable/masked token gives loss 0 instead of 0/0 (its sum is 0 anyway).
    `maskable` defaults to the one stored by `corrupt` (all True if none).
    """
    masked = corruption.masked_positions
    if maskable is None:
        maskable = corruption.maskable
    if maskable is None:
        maskable = torch.ones_like(masked, dtype=torch.bool)
    elif maskable.dtype != torch.bool or maskable.shape != masked.shape:
        raise ValueError(f"maskable must be a bool tensor of shape {tuple(masked.shape)}, got "
                         f"{maskable.dtype} with shape {tuple(maskable.shape)}")
    masked = masked & maskable
    zeros = torch.zeros(masked.shape, dtype=torch.float32, device=masked.device)
    n_maskable = maskable.sum(dim=1, keepdim=True).to(torch.float32)
    if cfg.loss_weight == "inverse_p" and cfg.block_diffusion and cfg.t_min > 0.5:
        weights = masked.to(torch.float32)  # BD3-LM's clipped schedule: a constant weight above 0.5
    elif cfg.loss_weight == "inverse_p":
        weights = torch.where(masked, 1.0 / corruption.p_mask.to(torch.float32), zeros)
    elif cfg.loss_weight == "inverse_empirical":
        n_masked = masked.sum(dim=1, keepdim=True).to(torch.float32).clamp(min=1.0)
        weights = torch.where(masked, (n_maskable / n_masked).expand_as(zeros), zeros)
    elif cfg.loss_weight == "none":
        weights = masked.to(torch.float32)
    else:
        raise ValueError(f"DLMConfig.loss_weight={cfg.loss_weight!r} is not one of "
                         "['inverse_p', 'inverse_empirical', 'none']")
    if corruption.t_weight is not None:  # t drawn from q: the ELBO over uniform t, importance-weighted
        weights = weights * corruption.t_weight
    if cfg.loss_normalizer == "tokens":
        normalizer = maskable.sum()
    elif cfg.loss_normalizer == "masked":
        normalizer = masked.sum()
    elif cfg.loss_normalizer == "sequence":
        weights = weights / n_maskable.clamp(min=1.0)
        normalizer = (n_maskable > 0).sum()
    else:
        raise ValueError(f"DLMConfig.loss_normalizer={cfg.loss_normalizer!r} is not one of "
                         "['tokens', 'masked', 'sequence']")
    normalizer = normalizer.to(torch.float32)
    if clamp_normalizer:
        normalizer = normalizer.clamp(min=1.0)
    return weights, normalizer


def varilen_length(cfg: DLMConfig, iteration: int, batch_position: int, seq_length: int,
                   multiple_of: int = 1) -> int:
    """Training length of a micro-batch: usually seq_length, with probability cfg.varilen_prob a
    length uniform in [1, seq_length] rounded down to a multiple of `multiple_of` (>= multiple_of).

    Keyed on (cfg.seed, iteration, batch_position) in python integers, where batch_position is
    the place of the micro-batch's first sample in the global batch: every rank computes the
    same answer without communication or device work, and a micro-batch gets the same length
    whichever data-parallel rank or accumulation step trains it (DP=2 equals one process
    accumulating two micro-batches).
    """
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    if multiple_of < 1 or multiple_of > seq_length:
        raise ValueError(f"multiple_of={multiple_of} must be in [1, seq_length={seq_length}]")
    coin = keyed_bits(cfg.seed, 0, _TAG_VARILEN_COIN, int(iteration), int(batch_position)) >> 8
    if not coin * _U24 < cfg.varilen_prob:
        return seq_length
    draw = keyed_bits(cfg.seed, 0, _TAG_VARILEN_LEN, int(iteration), int(batch_position)) >> 8
    length = 1 + ((draw * seq_length) >> 24)      # exact integer map of a 24-bit uniform to [1, L]
    return max(multiple_of, length // multiple_of * multiple_of)
