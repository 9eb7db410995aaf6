"""Core attention: one interface, several interchangeable backends.

``core_attention(q, k, v, mask, backend=...)`` is the only entry the model calls. Backends
register by name behind ``register_attention_backend`` so optional kernels (Transformer
Engine, flash-attn) can be added in one place without ``if HAVE_X`` in model code.

Built-ins:
  * ``math``  fp32 reference with an explicit softmax; used by tests.
  * ``sdpa``  torch scaled_dot_product_attention; on CUDA it prefers the cuDNN kernel,
              the fastest one on Hopper (DESIGN.md section 4).
  * ``flex``  FlexAttention with block masks, for structured masks and packed documents
              where SDPA would need a dense ``s x s`` mask.
  * ``auto``  resolves to one of the above per call (``resolve_backend``).

Shapes: q ``[b, hq, s, d]``, k/v ``[b, hkv, s, d]`` with ``hq % hkv == 0``; query head h
uses kv head ``h // (hq // hkv)`` (the grouping of ``repeat_interleave`` and of SDPA's
``enable_gqa``). With an explicit mask (generation with a KV cache) k/v may hold a different
number of positions than q: ``[b, hkv, k, d]`` under a ``[b, q, k]`` mask.
"""

import contextlib
import functools
import inspect
import math
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

from megatron.core.inference.kv_cache import compiler_disabled
from megatron.core.transformer.attention_mask import AttentionMask, block_diffusion_allowed

AttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, mask, softmax_scale, dropout_p) -> [b, hq, s, d]``; inputs already validated,
``softmax_scale`` already resolved to a float."""

_BACKENDS: Dict[str, AttentionFn] = {}


def register_attention_backend(name: str, fn: AttentionFn) -> None:
    """Make ``fn`` selectable as ``backend=name``. Re-registering a name replaces it, which
    lets an optional kernel package override a built-in deliberately."""
    if name == "auto":
        raise ValueError("'auto' is reserved: it resolves to a registered backend per call")
    _BACKENDS[name] = fn


def registered_backends() -> List[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionFn:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; registered backends: "
            f"{', '.join(registered_backends())} (or 'auto')"
        )
    return _BACKENDS[name]


def resolve_backend(
    backend: str,
    mask: AttentionMask,
    device: Union[torch.device, str],
    dropout_p: float = 0.0,
) -> str:
    """The concrete backend ``backend`` stands for on ``device``; explicit names pass through.

    ``auto`` on CUDA: SDPA (cuDNN) for full and plain causal masks, since those need no mask
    tensor; FlexAttention for block-causal, sliding-window and document masks, where SDPA
    would read a dense ``b x s x s`` mask and skip no masked-out tiles. Flex has no dropout,
    so dropout forces SDPA, and an explicit mask (generation) is already dense, so SDPA reads
    it directly. Elsewhere (CPU tests, other devices) SDPA is the robust choice: eager flex on
    CPU materialises scores and has no backward.
    """
    if backend != "auto":
        get_attention_backend(backend)  # fail early with the list of names
        return backend
    device_type = torch.device(device).type
    if device_type != "cuda":
        return "sdpa"
    if mask.is_full or mask.is_causal or mask.is_explicit or dropout_p > 0.0:
        return "sdpa"
    return "flex"


def _validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> None:
    # Shape checks come before any heavy work so a wrong layout fails with a clear message
    # instead of deep inside a kernel.
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"core_attention expects 4-D [b, heads, s, d] tensors, got q {tuple(q.shape)},"
            f" k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    b, hq, s, d = q.shape
    # Only an explicit mask (KV cache) or one with positions (a rank's queries against more
    # keys) may pair s queries with a different number of keys.
    if k.shape[0] != b or k.shape[3] != d or (k.shape[2] != s and not (mask.is_explicit or mask.has_positions)):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, sequence and"
            " head dim (self-attention; only an explicit mask or positions allow other key lengths)"
        )
    if hq % k.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
    mask.validate(s, batch_size=b, key_len=k.shape[2])


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    backend: str = "auto",
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of q over k/v under ``mask``; returns ``[b, hq, s, d]`` in q's dtype (s = q's length).

    ``softmax_scale`` defaults to ``1/sqrt(d)``. ``dropout_p`` is applied whenever it is
    non-zero: callers pass 0.0 in evaluation.
    """
    _validate_inputs(q, k, v, mask)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    name = resolve_backend(backend, mask, q.device, dropout_p)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = get_attention_backend(name)(q, k, v, mask, scale, dropout_p)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------- math
def math_attention(q, k, v, mask: AttentionMask, softmax_scale: float, dropout_p: float):
    """The reference: fp32, explicit scores and softmax, kv heads repeated for GQA."""
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float(), v.float()
    if groups > 1:
        kf = kf.repeat_interleave(groups, dim=1)
        vf = vf.repeat_interleave(groups, dim=1)
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * softmax_scale
    allowed = mask.dense(q.shape[2], device=q.device, key_len=k.shape[2])
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, vf).to(q.dtype)


# ---------------------------------------------------------------------------- sdpa
def _sdpa_kernel_order():
    """(kernel order, whether sdpa_kernel accepts set_priority), computed once at import.

    On H200 cuDNN measured 534-561 vs 280 TFLOP/s for flash, fwd+bwd (DESIGN.md section 4).
    torch 2.11 already picks cuDNN first on Hopper, but that default has changed between
    releases, so we state the order. ``set_priority`` (torch >= 2.6) turns the list into
    an order rather than a mere allow-list; without it we keep SDPA's own order, since an
    allow-list alone would not make cuDNN first.
    """
    names = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    order = [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]
    return order, "set_priority" in inspect.signature(sdpa_kernel).parameters


# Plain module constants (not a cached factory) so torch.compile can trace the context
# manager when a whole layer is compiled.
_SDPA_ORDER, _SDPA_HAS_SET_PRIORITY = _sdpa_kernel_order()
# Megatron's --attention-backend flash: the flash kernel first, the others where it cannot run
# (an explicit mask, an unsupported head size).
_SDPA_FLASH_ORDER = sorted(_SDPA_ORDER, key=lambda kernel: kernel.name != "FLASH_ATTENTION")


def _sdpa_kernel_context(device: torch.device, order=None):
    if device.type == "cuda" and _SDPA_HAS_SET_PRIORITY:
        return sdpa_kernel(_SDPA_ORDER if order is None else order, set_priority=True)
    return contextlib.nullcontext()


def sdpa_attention(q, k, v, mask: AttentionMask, softmax_scale: float, dropout_p: float, order=None):
    """torch SDPA; ``is_causal`` / no mask when exact, else the dense bool mask.

    GQA goes through ``enable_gqa`` rather than repeating kv heads: on H200 with torch 2.11
    the cuDNN kernel accepts it natively, and repeating measured 5-10% slower (the extra
    copies) at b2 hq16 hkv4 s4096 d128 bf16. ``order``: the kernel priority (default cuDNN first).
    """
    kwargs = dict(dropout_p=dropout_p, scale=softmax_scale)
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    if mask.is_causal:
        kwargs["is_causal"] = True
    elif not mask.is_full:
        kwargs["attn_mask"] = mask.dense(q.shape[2], device=q.device, key_len=k.shape[2])
    with _sdpa_kernel_context(q.device, order):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_flash_attention(q, k, v, mask: AttentionMask, softmax_scale: float, dropout_p: float):
    """SDPA with the flash kernel first (Megatron's ``--attention-backend flash``)."""
    return sdpa_attention(q, k, v, mask, softmax_scale, dropout_p, order=_SDPA_FLASH_ORDER)


# ---------------------------------------------------------------------------- flex
def _structure_mask_mod(mask: AttentionMask):
    """The mask type's rule as a FlexAttention mask_mod; None means "every key"."""
    if mask.mask_type == "causal":
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    if mask.mask_type == "block_causal":
        block = mask.block_size
        return lambda b, h, q_idx, kv_idx: (kv_idx // block) <= (q_idx // block)
    if mask.mask_type == "sliding_window":
        window = mask.window
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx >= 0) & (q_idx - kv_idx < window)
    if mask.mask_type == "sliding_window_two_sided":
        window = mask.window
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < window) & (kv_idx - q_idx < window)
    if mask.mask_type == "block_diffusion":
        noisy, block, causal_clean = mask.noisy_length, mask.block_size, mask.causal_clean
        return lambda b, h, q_idx, kv_idx: block_diffusion_allowed(q_idx, kv_idx, noisy, block, causal_clean)
    return None


def _document_mask_mod(document_ids: torch.Tensor):
    def same_document(b, h, q_idx, kv_idx):
        return document_ids[b, q_idx] == document_ids[b, kv_idx]

    return same_document


@functools.lru_cache(maxsize=1)
def _compiled_flex_functions():
    # Compiled once per process and reused, so every layer and step hits the same cache.
    return torch.compile(flex_attention), torch.compile(create_block_mask)


def _flex_functions(device_type: str):
    """(flex_attention, create_block_mask) to call: compiled on CUDA, eager elsewhere.

    Uncompiled flex materialises the full score matrix, so on GPU it must be compiled to
    get the fused kernel. Inside an enclosing torch.compile the plain functions are traced
    into that graph instead (and dynamo would ignore the lru_cache anyway). On CPU (tests)
    eager avoids minutes of compile time for a few tiny calls.
    """
    if device_type != "cuda" or torch.compiler.is_compiling():
        return flex_attention, create_block_mask
    return _compiled_flex_functions()


def _build_block_mask(mask_mod, batch: Optional[int], seq_len: int, device: torch.device,
                      key_len: Optional[int] = None):
    _, build = _flex_functions(device.type)
    # H=None: the pattern is the same for every head, so one mask serves all of them.
    return build(mask_mod, batch, None, seq_len, key_len or seq_len, device=device)


def _at_positions(mask_mod, query_positions: torch.Tensor, key_positions: torch.Tensor):
    """`mask_mod` (a rule on global positions) read at the rank's query / key indices."""
    def at_positions(b, h, q_idx, kv_idx):
        return mask_mod(b, h, query_positions[q_idx], key_positions[kv_idx])

    return at_positions


@functools.lru_cache(maxsize=64)
def _cached_structure_block_mask(mask: AttentionMask, seq_len: int, device: torch.device):
    # Without documents the block mask depends only on the mask's structure (its hash and
    # equality are by value), the length and the device, so it is built once per shape
    # instead of on every layer and step.
    return _build_block_mask(_structure_mask_mod(mask), None, seq_len, device)


@compiler_disabled
def _document_block_mask(mask: AttentionMask, seq_len: int, device: torch.device, key_len: Optional[int] = None):
    # Built outside any enclosing torch.compile graph (a graph break there) on purpose:
    # with torch 2.11 on H200, create_block_mask with a batch dimension traced into the
    # same graph as flex_attention gave wrong outputs for batch rows > 0 at s=128 and an
    # illegal memory access at s=256; built by its own compiled function it is correct.
    # Masks with positions are built here too: they change with every batch of positions.
    mask_mod = _structure_mask_mod(mask)
    batch = None
    if mask.has_documents:
        document_ids = mask.document_ids.to(device)
        batch = document_ids.shape[0]
        documents = _document_mask_mod(document_ids)
        mask_mod = documents if mask_mod is None else and_masks(documents, mask_mod)
    if mask_mod is None:  # no_mask at positions: every key
        mask_mod = _every_key
    if mask.has_positions:
        mask_mod = _at_positions(mask_mod, *mask.positions(seq_len, key_len, device))
    return _build_block_mask(mask_mod, batch, seq_len, device, key_len)


def _every_key(b, h, q_idx, kv_idx):
    return q_idx >= 0


def flex_block_mask(mask: AttentionMask, seq_len: int, device: torch.device, key_len: Optional[int] = None):
    """The FlexAttention BlockMask for ``mask`` (None for a full mask)."""
    device = torch.device(device)
    if mask.is_full:
        return None
    if mask.has_documents or mask.has_positions:
        return _document_block_mask(mask, seq_len, device, key_len)
    if torch.compiler.is_compiling():
        # Dynamo ignores lru_cache anyway; inside a compiled graph the mask is part of it.
        return _build_block_mask(_structure_mask_mod(mask), None, seq_len, device)
    return _cached_structure_block_mask(mask, seq_len, device)


def flex_attention_backend(q, k, v, mask: AttentionMask, softmax_scale: float, dropout_p: float):
    """FlexAttention with a block mask, so fully masked tiles are skipped on GPU.

    An explicit mask has no structure to turn into a block mask (and would need a new one
    every decoding step), so it goes to SDPA, which reads the dense tensor directly.
    """
    if mask.is_explicit:
        return sdpa_attention(q, k, v, mask, softmax_scale, dropout_p)
    if dropout_p > 0.0:
        raise ValueError("flex does not support attention dropout; use sdpa or math")
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v)
    ):
        # torch raises NotImplementedError deep inside; say what to do instead.
        raise ValueError(
            "flex has no backward on CPU in torch; use backend 'sdpa' or 'math' on CPU"
            " ('auto' does), or run under torch.no_grad()"
        )
    attend, _ = _flex_functions(q.device.type)
    block_mask = flex_block_mask(mask, q.shape[2], q.device, k.shape[2])
    enable_gqa = q.shape[1] != k.shape[1]
    return attend(
        q, k, v, block_mask=block_mask, scale=softmax_scale, enable_gqa=enable_gqa
    )


register_attention_backend("math", math_attention)
register_attention_backend("sdpa", sdpa_attention)
register_attention_backend("sdpa_flash", sdpa_flash_attention)
register_attention_backend("flex", flex_attention_backend)
