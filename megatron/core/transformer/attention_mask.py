"""The attention-mask description shared by every core-attention backend.

A mask is described, not materialised: backends that have a fast path for a pattern
(SDPA's ``is_causal``, FlexAttention's block masks) use the description directly, and
``AttentionMask.dense`` is the one reference materialisation that everything else is
tested against.

The structured types are self-attention patterns over one sequence: a rule on the
(query position, key position) pair. By default a rank holds every query and every key
(positions 0..s-1); with ``query_positions`` / ``key_positions`` it holds some of them, at the
global positions given (context parallelism: a rank's query chunks against the gathered keys),
and every rule, documents included, is evaluated at those true positions. The ``explicit``
type carries a ready-made boolean ``[b, q, k]`` tensor instead: generation builds it from
absolute positions (left padding, KV-cache slots) with q != k, and every backend reads it
as is.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.transformer.transformer_config import (ATTENTION_MASK_TYPES, WINDOW_MASK_TYPES, DLMConfig,
                                                          TransformerConfig)

# The mask types a model trains with (one list: transformer_config.py), block diffusion's mask over
# [x_t ; x_0] (--difflm-block-diffusion builds it, no --attention-mask-type names it), and an explicit
# bool tensor.
MASK_TYPES = ATTENTION_MASK_TYPES + ("block_diffusion", "explicit")


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """Which keys each query may attend to.

    Equality is by value (document ids compared with ``torch.equal``); the dataclass
    default would compare tensors elementwise and fail on ``bool()``.
    """

    mask_type: str
    """One of ``MASK_TYPES``: ``no_mask`` (bidirectional), ``causal``, ``block_causal``
    (query i sees key j iff ``j // block_size <= i // block_size``), ``sliding_window``
    (query i sees key j iff ``0 <= i - j < window``), ``sliding_window_two_sided`` (iff
    ``|i - j| < window``, for DLMs), ``block_diffusion`` (BD3-LM's mask over
    ``[x_t ; x_0]``, see ``block_diffusion_allowed``), ``explicit`` (the ``allowed`` tensor)."""

    block_size: Optional[int] = None
    """Block length for ``block_causal`` and ``block_diffusion``; must divide the sequence length."""

    noisy_length: Optional[int] = None
    """``block_diffusion`` only: L, the length of the noisy half; the sequence is 2L tokens."""

    causal_clean: bool = False
    """``block_diffusion`` only: the clean half is token-causal (query j sees clean keys <= j) instead of
    block-causal; the joint AR + DLM objective's mask (DLMConfig.causal_clean_half)."""

    window: Optional[int] = None
    """``sliding_window``: the keys visible (the query's own included); ``sliding_window_two_sided``:
    the largest distance seen, plus one, on either side."""

    document_ids: Optional[torch.Tensor] = None
    """``[b, s]`` integer ids of packed documents: query i sees key j only if both carry
    the same id, in addition to the mask type's rule. Padding is its own id, so every
    query still sees at least itself and no softmax row is empty."""

    allowed: Optional[torch.Tensor] = None
    """``[b, q, k]`` bool, True where query i may attend key j; only for ``explicit``. The
    caller guarantees every row has a True entry (an empty softmax row would be NaN)."""

    query_positions: Optional[torch.Tensor] = None
    """``[q]`` integer global positions of the queries held (None: 0..q-1). ``document_ids``
    then describe the whole sequence, ``[b, S]``, and are read at these positions."""

    key_positions: Optional[torch.Tensor] = None
    """``[k]`` integer global positions of the keys held (None: 0..k-1)."""

    def __post_init__(self) -> None:
        # Checks that need no sequence length run at construction so a bad config
        # fails where it is built, not at the first forward.
        if self.mask_type not in MASK_TYPES:
            raise ValueError(
                f"AttentionMask.mask_type={self.mask_type!r} is not one of {MASK_TYPES}"
            )
        if self.mask_type in ("block_causal", "block_diffusion"):
            if self.block_size is None or self.block_size < 1:
                raise ValueError(
                    f"AttentionMask.block_size must be a positive int for mask_type={self.mask_type!r}"
                    f" (got {self.block_size!r}); set the block size of block diffusion"
                )
        if (self.mask_type == "block_diffusion") != (self.noisy_length is not None):
            raise ValueError("AttentionMask.noisy_length must be given exactly when mask_type='block_diffusion'")
        if self.causal_clean and self.mask_type != "block_diffusion":
            raise ValueError("AttentionMask.causal_clean applies to mask_type='block_diffusion' only")
        if (self.mask_type == "explicit") != (self.allowed is not None):
            raise ValueError("AttentionMask.allowed must be given exactly when mask_type='explicit'")
        if self.mask_type == "explicit" and (self.document_ids is not None or self.has_positions):
            raise ValueError("AttentionMask(mask_type='explicit') takes no document_ids or positions; fold them "
                             "into allowed")
        if self.mask_type in WINDOW_MASK_TYPES:
            if self.window is None or self.window < 1:
                raise ValueError(
                    f"AttentionMask.window must be a positive int for mask_type={self.mask_type!r}"
                    f" (got {self.window!r})"
                )

    # ------------------------------------------------------------------ properties
    @property
    def has_documents(self) -> bool:
        return self.document_ids is not None

    @property
    def has_positions(self) -> bool:
        """True when the queries or keys held are not simply 0..s-1 (see ``query_positions``)."""
        return self.query_positions is not None or self.key_positions is not None

    @property
    def is_explicit(self) -> bool:
        return self.mask_type == "explicit"

    @property
    def is_causal(self) -> bool:
        """True when the whole mask is plain causal, i.e. SDPA's ``is_causal=True`` is exact."""
        return self.mask_type == "causal" and not self.has_documents and not self.has_positions

    @property
    def is_full(self) -> bool:
        """True when every query sees every key (no mask tensor needed at all)."""
        return self.mask_type == "no_mask" and not self.has_documents

    @property
    def structure_key(self) -> tuple:
        """The parameters that define the pattern (ignoring document ids).

        Fields irrelevant to the mask type are dropped so that e.g. a causal mask built
        with a leftover ``block_size`` still hits the same cache entry.
        """
        if self.mask_type == "block_causal":
            return (self.mask_type, self.block_size)
        if self.mask_type == "block_diffusion":
            return (self.mask_type, self.block_size, self.noisy_length, self.causal_clean)
        if self.mask_type in WINDOW_MASK_TYPES:
            return (self.mask_type, self.window)
        return (self.mask_type,)

    # ------------------------------------------------------------------ validation
    def validate(self, seq_len: int, batch_size: Optional[int] = None, key_len: Optional[int] = None) -> None:
        """Raise ValueError naming the offending field if the mask cannot apply to
        ``seq_len`` queries (and, when given, batches of ``batch_size`` and ``key_len`` keys;
        ``key_len != seq_len`` needs an explicit mask or positions)."""
        if self.is_explicit:
            self._validate_explicit(seq_len, batch_size, key_len)
            return
        keys = seq_len if key_len is None else key_len
        if keys != seq_len and not self.has_positions:
            raise ValueError(f"{keys} keys for {seq_len} queries need an explicit mask "
                             "(AttentionMask('explicit', allowed=...)) or query/key positions")
        for name, positions, count in (("query_positions", self.query_positions, seq_len),
                                       ("key_positions", self.key_positions, keys)):
            if positions is not None and (positions.dim() != 1 or positions.numel() != count
                                          or positions.dtype.is_floating_point or positions.dtype == torch.bool):
                raise ValueError(f"AttentionMask.{name} must be a [{count}] integer tensor, got "
                                 f"{positions.dtype} of shape {tuple(positions.shape)}")
        if self.mask_type == "block_causal" and not self.has_positions and seq_len % self.block_size != 0:
            raise ValueError(
                f"AttentionMask.block_size={self.block_size} does not divide the sequence"
                f" length {seq_len}; pad sequences to a multiple of the block size"
            )
        if self.mask_type == "block_diffusion" and self.noisy_length % self.block_size != 0:
            raise ValueError(f"AttentionMask.block_size={self.block_size} does not divide the noisy length "
                             f"{self.noisy_length}; pad sequences to a multiple of the block size")
        if self.mask_type == "block_diffusion" and not self.has_positions and seq_len != 2 * self.noisy_length:
            raise ValueError(f"a block_diffusion mask over [x_t ; x_0] needs {2 * self.noisy_length} tokens "
                             f"(twice noisy_length), got {seq_len}")
        if self.document_ids is not None:
            self._validate_documents(seq_len, batch_size, keys)

    def _validate_documents(self, seq_len: int, batch_size: Optional[int], keys: int) -> None:
        ids = self.document_ids
        # With positions the ids describe the whole sequence (at least every key held).
        length_ok = ids.dim() == 2 and (ids.shape[1] >= keys if self.has_positions else ids.shape[1] == seq_len)
        if not length_ok or (batch_size is not None and ids.shape[0] != batch_size):
            expected = f"[{batch_size if batch_size is not None else 'b'}, {seq_len}]"
            if self.has_positions:
                expected = f"[{batch_size if batch_size is not None else 'b'}, >= {keys}] (the whole sequence)"
            raise ValueError(
                f"AttentionMask.document_ids has shape {tuple(ids.shape)}, expected {expected}"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(
                f"AttentionMask.document_ids must be an integer tensor, got {ids.dtype}"
            )

    def _validate_explicit(self, seq_len: int, batch_size: Optional[int], key_len: Optional[int]) -> None:
        allowed = self.allowed
        expected = (batch_size, seq_len, key_len)
        if allowed.dim() != 3 or any(want is not None and got != want for got, want in zip(allowed.shape, expected)):
            raise ValueError(f"AttentionMask.allowed has shape {tuple(allowed.shape)}, expected "
                             f"[{batch_size or 'b'}, {seq_len}, {key_len or 'k'}]")
        if allowed.dtype != torch.bool:
            raise ValueError(f"AttentionMask.allowed must be a bool tensor, got {allowed.dtype}")

    # ------------------------------------------------------------------ materialisation
    def dense(self, seq_len: int, device=None, key_len: Optional[int] = None) -> torch.Tensor:
        """Bool ``[b or 1, 1, q, k]``, True where query (dim -2) may attend key (dim -1).

        This is the reference definition: the math backend and SDPA's general path use
        it, and FlexAttention's mask_mods are tested against it. An explicit mask is
        returned as given, ``[b, 1, q, k]``.
        """
        self.validate(seq_len, key_len=key_len)
        if self.is_explicit:
            return self.allowed.to(device)[:, None]
        q_pos, k_pos = self.positions(seq_len, key_len, device)
        q_pos, k_pos = q_pos[:, None], k_pos[None, :]
        if self.mask_type == "no_mask":
            allowed = torch.ones(q_pos.shape[0], k_pos.shape[1], dtype=torch.bool, device=device)
        elif self.mask_type == "causal":
            allowed = k_pos <= q_pos
        elif self.mask_type == "block_causal":
            allowed = (k_pos // self.block_size) <= (q_pos // self.block_size)
        elif self.mask_type == "block_diffusion":
            allowed = block_diffusion_allowed(q_pos, k_pos, self.noisy_length, self.block_size, self.causal_clean)
        elif self.mask_type == "sliding_window_two_sided":
            allowed = (q_pos - k_pos).abs() < self.window
        else:  # sliding_window
            distance = q_pos - k_pos
            allowed = (distance >= 0) & (distance < self.window)
        allowed = allowed[None, None]
        if self.document_ids is not None:
            ids = self.document_ids.to(device)
            query_ids, key_ids = ids[:, q_pos[:, 0]], ids[:, k_pos[0]]
            allowed = allowed & (query_ids[:, None, :, None] == key_ids[:, None, None, :])
        return allowed

    def positions(self, seq_len: int, key_len: Optional[int] = None, device=None):
        """(query positions [q], key positions [k]) on `device`: the given ones or 0..n-1."""
        keys = seq_len if key_len is None else key_len
        q_pos = (self.query_positions.to(device) if self.query_positions is not None
                 else torch.arange(seq_len, device=device))
        k_pos = self.key_positions.to(device) if self.key_positions is not None else torch.arange(keys, device=device)
        return q_pos, k_pos

    # ------------------------------------------------------------------ value semantics
    def __eq__(self, other) -> bool:
        if not isinstance(other, AttentionMask):
            return NotImplemented
        if self.structure_key != other.structure_key:
            return False
        return all(_same_tensor(getattr(self, name), getattr(other, name))
                   for name in ("allowed", "document_ids", "query_positions", "key_positions"))

    def __hash__(self) -> int:
        # Consistent with __eq__: equal masks share structure and which tensors they carry.
        return hash((self.structure_key, self.document_ids is not None, self.query_positions is not None,
                     self.key_positions is not None))


def block_diffusion_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, noisy_length: int, block_size: int,
                            causal_clean: bool = False):
    """BD3-LM's vectorised training mask over [x_t ; x_0] (positions < noisy_length are noisy):
    a noisy block sees itself (block-diagonal) and the clean blocks before it (offset block-causal);
    a clean block sees the clean blocks up to itself (block-causal) and no noisy token. So one
    forward gives every block's denoiser conditioned on the clean prefix, as sampling sees it.
    `causal_clean`: a clean token sees the clean tokens up to itself (causal), so the clean half is
    an AR model's forward (the joint AR + DLM objective); the noisy half's rule is unchanged.
    Works on broadcastable integer tensors (the dense mask, FlexAttention's mask_mod)."""
    q_noisy, k_noisy = q_pos < noisy_length, k_pos < noisy_length
    q_block = torch.where(q_noisy, q_pos, q_pos - noisy_length) // block_size
    k_block = torch.where(k_noisy, k_pos, k_pos - noisy_length) // block_size
    clean_rule = (k_pos <= q_pos) if causal_clean else (k_block <= q_block)
    return ((q_noisy & k_noisy & (q_block == k_block)) | (q_noisy & ~k_noisy & (k_block < q_block))
            | (~q_noisy & ~k_noisy & clean_rule))


def _same_tensor(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))


def build_attention_mask(config: TransformerConfig, dlm_config: DLMConfig,
                         document_ids: Optional[torch.Tensor] = None,
                         mask_type: Optional[str] = None, query_positions: Optional[torch.Tensor] = None,
                         key_positions: Optional[torch.Tensor] = None,
                         noisy_length: Optional[int] = None) -> AttentionMask:
    """The mask of a running mode: the DLM mask type, or causal for the vanilla (AR) mode; with
    positions, for the queries and keys a rank holds of the sequence (context parallelism).
    Block diffusion's mask needs `noisy_length`, the L of its [x_t ; x_0] input."""
    mask_type = mask_type or dlm_config.effective_mask_type
    return AttentionMask(mask_type=mask_type,
                         block_size=dlm_config.block_size if mask_type in ("block_causal", "block_diffusion") else None,
                         noisy_length=noisy_length if mask_type == "block_diffusion" else None,
                         causal_clean=mask_type == "block_diffusion" and dlm_config.causal_clean_half,
                         window=config.sliding_window if mask_type in WINDOW_MASK_TYPES else None,
                         document_ids=document_ids, query_positions=query_positions, key_positions=key_positions)
