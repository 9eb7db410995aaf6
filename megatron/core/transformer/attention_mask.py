"""The attention-mask description shared by every core-attention backend.

A mask is described, not materialised: backends that have a fast path for a pattern
(SDPA's ``is_causal``, FlexAttention's block masks) use the description directly, and
``AttentionMask.dense`` is the one reference materialisation that everything else is
tested against.

The structured types are self-attention patterns (query length == key length), so
"causal" is the same whether it is read top-left or bottom-right aligned. The ``explicit``
type carries a ready-made boolean ``[b, q, k]`` tensor instead: generation builds it from
absolute positions (left padding, KV-cache slots) with q != k, and every backend reads it
as is.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.transformer.transformer_config import ATTENTION_MASK_TYPES, DLMConfig, TransformerConfig

# The mask types a model trains with (one list: transformer_config.py), plus an explicit bool tensor.
MASK_TYPES = ATTENTION_MASK_TYPES + ("explicit",)


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """Which keys each query may attend to.

    Equality is by value (document ids compared with ``torch.equal``); the dataclass
    default would compare tensors elementwise and fail on ``bool()``.
    """

    mask_type: str
    """One of ``MASK_TYPES``: ``no_mask`` (bidirectional), ``causal``, ``block_causal``
    (query i sees key j iff ``j // block_size <= i // block_size``), ``sliding_window``
    (query i sees key j iff ``0 <= i - j < window``), ``explicit`` (the ``allowed`` tensor)."""

    block_size: Optional[int] = None
    """Block length for ``block_causal``; must divide the sequence length."""

    window: Optional[int] = None
    """Number of visible keys (including the query's own position) for ``sliding_window``."""

    document_ids: Optional[torch.Tensor] = None
    """``[b, s]`` integer ids of packed documents: query i sees key j only if both carry
    the same id, in addition to the mask type's rule. Padding is its own id, so every
    query still sees at least itself and no softmax row is empty."""

    allowed: Optional[torch.Tensor] = None
    """``[b, q, k]`` bool, True where query i may attend key j; only for ``explicit``. The
    caller guarantees every row has a True entry (an empty softmax row would be NaN)."""

    def __post_init__(self) -> None:
        # Checks that need no sequence length run at construction so a bad config
        # fails where it is built, not at the first forward.
        if self.mask_type not in MASK_TYPES:
            raise ValueError(
                f"AttentionMask.mask_type={self.mask_type!r} is not one of {MASK_TYPES}"
            )
        if self.mask_type == "block_causal":
            if self.block_size is None or self.block_size < 1:
                raise ValueError(
                    "AttentionMask.block_size must be a positive int for mask_type='block_causal'"
                    f" (got {self.block_size!r}); set the block size of block diffusion"
                )
        if (self.mask_type == "explicit") != (self.allowed is not None):
            raise ValueError("AttentionMask.allowed must be given exactly when mask_type='explicit'")
        if self.mask_type == "explicit" and self.document_ids is not None:
            raise ValueError("AttentionMask(mask_type='explicit') takes no document_ids; fold them into allowed")
        if self.mask_type == "sliding_window":
            if self.window is None or self.window < 1:
                raise ValueError(
                    "AttentionMask.window must be a positive int for mask_type='sliding_window'"
                    f" (got {self.window!r})"
                )

    # ------------------------------------------------------------------ properties
    @property
    def has_documents(self) -> bool:
        return self.document_ids is not None

    @property
    def is_explicit(self) -> bool:
        return self.mask_type == "explicit"

    @property
    def is_causal(self) -> bool:
        """True when the whole mask is plain causal, i.e. SDPA's ``is_causal=True`` is exact."""
        return self.mask_type == "causal" and not self.has_documents

    @property
    def is_full(self) -> bool:
        """True when every query sees every key (no mask tensor needed at all)."""
        return self.mask_type == "no_mask" and not self.has_documents

    @property
    def needs_dense_mask(self) -> bool:
        """True when SDPA can only express this mask as a dense ``[.., s, s]`` tensor."""
        return not (self.is_full or self.is_causal)

    @property
    def structure_key(self) -> tuple:
        """The parameters that define the pattern (ignoring document ids).

        Fields irrelevant to the mask type are dropped so that e.g. a causal mask built
        with a leftover ``block_size`` still hits the same cache entry.
        """
        if self.mask_type == "block_causal":
            return (self.mask_type, self.block_size)
        if self.mask_type == "sliding_window":
            return (self.mask_type, self.window)
        return (self.mask_type,)

    # ------------------------------------------------------------------ validation
    def validate(self, seq_len: int, batch_size: Optional[int] = None, key_len: Optional[int] = None) -> None:
        """Raise ValueError naming the offending field if the mask cannot apply to
        sequences of ``seq_len`` queries (and, when given, batches of ``batch_size`` and
        ``key_len`` keys; only an explicit mask allows ``key_len != seq_len``)."""
        if self.is_explicit:
            self._validate_explicit(seq_len, batch_size, key_len)
            return
        if key_len is not None and key_len != seq_len:
            raise ValueError(f"{key_len} keys for {seq_len} queries need an explicit mask "
                             "(AttentionMask('explicit', allowed=...)); the structured types are self-attention")
        if self.mask_type == "block_causal" and seq_len % self.block_size != 0:
            raise ValueError(
                f"AttentionMask.block_size={self.block_size} does not divide the sequence"
                f" length {seq_len}; pad sequences to a multiple of the block size"
            )
        if self.document_ids is None:
            return
        ids = self.document_ids
        if ids.dim() != 2 or ids.shape[1] != seq_len or (
            batch_size is not None and ids.shape[0] != batch_size
        ):
            expected = f"[{batch_size if batch_size is not None else 'b'}, {seq_len}]"
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
    def dense(self, seq_len: int, device=None) -> torch.Tensor:
        """Bool ``[b or 1, 1, s, s]``, True where query (dim -2) may attend key (dim -1).

        This is the reference definition: the math backend and SDPA's general path use
        it, and FlexAttention's mask_mods are tested against it. An explicit mask is
        returned as given, ``[b, 1, q, k]``.
        """
        self.validate(seq_len)
        if self.is_explicit:
            return self.allowed.to(device)[:, None]
        q_pos = torch.arange(seq_len, device=device)[:, None]
        k_pos = torch.arange(seq_len, device=device)[None, :]
        if self.mask_type == "no_mask":
            allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
        elif self.mask_type == "causal":
            allowed = k_pos <= q_pos
        elif self.mask_type == "block_causal":
            allowed = (k_pos // self.block_size) <= (q_pos // self.block_size)
        else:  # sliding_window
            distance = q_pos - k_pos
            allowed = (distance >= 0) & (distance < self.window)
        allowed = allowed[None, None]
        if self.document_ids is not None:
            ids = self.document_ids.to(device)
            same_document = ids[:, None, :, None] == ids[:, None, None, :]
            allowed = allowed & same_document
        return allowed

    # ------------------------------------------------------------------ value semantics
    def __eq__(self, other) -> bool:
        if not isinstance(other, AttentionMask):
            return NotImplemented
        if self.structure_key != other.structure_key:
            return False
        if self.is_explicit:
            return self.allowed.shape == other.allowed.shape and bool(
                torch.equal(self.allowed.cpu(), other.allowed.cpu()))
        if self.document_ids is None or other.document_ids is None:
            return self.document_ids is None and other.document_ids is None
        return self.document_ids.shape == other.document_ids.shape and bool(
            torch.equal(self.document_ids.cpu(), other.document_ids.cpu())
        )

    def __hash__(self) -> int:
        # Consistent with __eq__: equal masks share structure and document presence.
        return hash((self.structure_key, self.document_ids is not None))


def build_attention_mask(config: TransformerConfig, dlm_config: DLMConfig,
                         document_ids: Optional[torch.Tensor] = None,
                         mask_type: Optional[str] = None) -> AttentionMask:
    """The mask of a running mode: the DLM mask type, or causal for the vanilla (AR) mode."""
    mask_type = mask_type or dlm_config.effective_mask_type
    return AttentionMask(mask_type=mask_type,
                         block_size=dlm_config.block_size if mask_type == "block_causal" else None,
                         window=config.sliding_window if mask_type == "sliding_window" else None,
                         document_ids=document_ids)
