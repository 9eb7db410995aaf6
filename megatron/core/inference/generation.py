"""Generation: masked-diffusion sampling (LLaDA-compatible) and autoregressive decoding.

This file imports only the standard library and torch: the Hugging Face exporter copies it
next to an exported ``modeling_dlm.py``, so it must run without megatron installed.

The model callable
------------------
``model_fn(input_ids, position_ids, attention_mask, kv_cache, cache_start) -> logits``

* ``input_ids``, ``position_ids``: ``[B, q]`` long. Positions count from each row's first
  real token, so a left-padded prompt gets the same positions as when run alone.
* ``attention_mask``: ``[B, q, K]`` bool, True where query i may attend key j. Every row has
  at least one True entry (a padding query sees itself), so no softmax row is empty.
* ``kv_cache``: None or a `KVCache`; ``cache_start``: the canvas index of ``input_ids[:, 0]``
  (an int; or the ``[q]`` int64 tensor of cache slots to write, on the model's device, which
  the model only hands on to the cache: CUDA graphs replay one capture for every offset).
* returns ``[B, q, V]`` float logits over the full vocabulary.

Without a cache, K == q and the q tokens are the whole sequence. With a cache, every
attention layer computes k/v of its q tokens (after k-norm and RoPE), calls
``kv_cache.update(layer_index, cache_start, k, v)`` and attends its queries against the
returned buffers (K == ``kv_cache.max_length``) under ``attention_mask``. The sampler builds
every mask from absolute positions (left padding, causal for AR, bidirectional for DLMs,
block-causal or sliding-window if the model was trained so), so the model has no mask logic.

Diffusion sampling (``difflm-noshift``, ``difflm-shift``)
-------------------------------------------------------
LLaDA's ``generate()``: the canvas is the prompt followed by ``gen_length`` mask tokens,
decoded in ``gen_length / block_length`` semi-autoregressive blocks with ``steps / blocks``
steps each; each step predicts every masked token of the block (a float64 draw from the
softmax at ``temperature``, after optional top-k / top-p filtering) and commits the ones LLaDA's
schedule asks for, chosen by ``remasking``: ``low_confidence`` (probability of the predicted
token) or ``random``. ``cfg_scale`` > 0 adds LLaDA's classifier-free guidance. In
``difflm-shift`` the logits at position i predict token i+1. Greedy decoding (and random
remasking under a fixed generator) reproduces LLaDA token for token; the deliberate
differences: the mask token is never predicted, samples are drawn by the inverse CDF (one
uniform a slot, the current block only) where LLaDA adds Gumbel noise to the whole canvas
(same distribution, other draws), and steps left with nothing to commit are skipped.
Opt-in speed-ups (Fast-dLLM): ``threshold`` commits every masked token of the block whose
confidence exceeds it (at least one per step, until the block is full; ``steps`` is then
unused), and ``cache`` = ``"prefix"`` / ``"dual"`` refreshes a KV cache
with one full pass at each block start, then re-runs only ``[block_start, end)`` (prefix)
or the block itself (dual) against it.

Pipeline stages
---------------
``stages`` (optional) runs the sampler on every stage of a pipeline-parallel model: ``model_fn`` returns
the logits on the last stage only (None elsewhere), ``stages.decides`` is True there, and after each
step ``stages.share(*tensors)`` overwrites the given tensors on every stage with the last stage's (the
canvas and the rows' finished flags; the entropy at the end). The loop's control flow reads only those,
so every stage runs the same forwards, each handing its activations to the next.

Random draws come from ``generator`` (one stream for the batch) or, with ``seeds`` (one integer a
row), from a stream per row keyed by the draw's place in the row's generation (block, step; AR: the
token index): a row then samples the same completion alone or in any batch.

End of sequence (both kinds)
----------------------------
With ``eos_token_id`` set, a row is finished once it holds a committed EOS in the generated
part and no mask token at or before that (first) EOS. Everything after that EOS is then
overwritten with ``pad_token_id`` (EOS when no pad id is given) and the row never changes
again. Generation stops as soon as every row is finished. For AR decoding a row is
finished when it emits EOS. The result always has the full shape
``[B, prompt_length + gen_length]``, left padding included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .generation_options import (ALIASES, CACHE_MODES, MASK_TYPES, REMASKING, RUNNING_MODES,  # noqa: F401
                                 SAMPLER_MASK_TYPES, GenerationOptions, resolve_options)
from .kv_cache import KVCache

__all__ = ["GenerationOptions", "generate", "resolve_options", "RUNNING_MODES"]

ModelFn = Callable[..., torch.Tensor]


# ---------------------------------------------------------------------------- canvas and masks
@dataclass
class CanvasLayout:
    """Which canvas slots hold real tokens, their positions, and the trained attention rule."""

    real: torch.Tensor
    """[B, L] bool: False on left padding."""
    positions: torch.Tensor
    """[B, L] long: counted from the row's first real token (0 on padding)."""
    opts: GenerationOptions

    def repeat(self, times: int) -> "CanvasLayout":
        return CanvasLayout(self.real.repeat(times, 1), self.positions.repeat(times, 1), self.opts)

    def attention_mask(self, q0: int, q1: int, key_length: int, noisy_from=None) -> torch.Tensor:
        """[B, q1 - q0, key_length] bool for queries at canvas slots [q0, q1) over keys [0, key_length).
        Block diffusion with causal clean blocks (GenerationOptions.causal_clean): the blocks before the
        one holding slot `noisy_from` (an int, or a [B] tensor of one slot a row; default the last
        query's) are clean, token-causal inside; from it on, bidirectional inside each block."""
        query = self.positions[:, q0:q1, None]
        key = self.positions[:, None, :key_length]
        mask_type = self.opts.attention_mask_type
        if mask_type == "no_mask":
            allowed = torch.ones_like(query == key)
        elif mask_type == "causal":
            allowed = key <= query
        elif mask_type in ("block_causal", "block_diffusion"):  # a block diffusion canvas holds clean blocks
            block = self.opts.attention_block_size
            allowed = (key // block) <= (query // block)
            if self.opts.causal_clean:
                slots = torch.as_tensor(q1 - 1 if noisy_from is None else noisy_from, device=query.device)
                noisy = self.positions.gather(1, slots.expand(query.shape[0])[:, None])[:, :, None] // block
                allowed = allowed & ((key // block < query // block) | (key <= query) | (query // block >= noisy))
        elif mask_type == "sliding_window_two_sided":
            allowed = (query - key).abs() < self.opts.sliding_window
        else:
            allowed = (query - key >= 0) & (query - key < self.opts.sliding_window)
        allowed = allowed & self.real[:, None, :key_length]
        # A padding query sees only its own slot: its output is discarded, but an empty row
        # would put NaNs through the softmax. A real query always sees itself anyway.
        slots = torch.arange(key_length, device=query.device)
        own = slots[None, :] == torch.arange(q0, q1, device=query.device)[:, None]
        return allowed | own


def _call_model(model_fn: ModelFn, ids: torch.Tensor, layout: CanvasLayout, q0: int, q1: int,
                cache: Optional[KVCache]) -> torch.Tensor:
    """Logits [B, q1 - q0, V] for canvas slots [q0, q1), in the model's dtype (callers keep the
    positions they need, then go to fp32); without a cache the run must start at 0."""
    key_length = cache.max_length if cache is not None else q1
    mask = layout.attention_mask(q0, q1, key_length)
    return model_fn(ids[:, q0:q1], layout.positions[:, q0:q1], mask, cache, q0)


def _check_inputs(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], running_mode: str,
                  mask_token_id: Optional[int], eos_token_id: Optional[int],
                  pad_token_id: Optional[int]) -> torch.Tensor:
    """Validate the prompt batch; return its real-token mask [B, P] (bool)."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be a [batch, prompt_length] integer tensor, got "
                         f"{tuple(input_ids.shape)} {input_ids.dtype}")
    if attention_mask is None:
        real = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
        real = attention_mask.bool()
        # Left padding: once a row's real tokens start, they run to the end.
        if (real[:, :-1] & ~real[:, 1:]).any():
            raise ValueError("attention_mask must use left padding (zeros before the prompt, ones after); "
                             "pad prompts on the left (tokenizer.padding_side = 'left')")
    if running_mode != "difflm-noshift" and (input_ids.shape[1] == 0 or not real[:, -1].all()):
        raise ValueError(f"running_mode={running_mode!r} predicts from the previous token, so every prompt "
                         "needs at least one real token")
    if running_mode != "vanilla" and not isinstance(mask_token_id, int):
        raise ValueError(f"running_mode={running_mode!r} needs mask_token_id (an int), got {mask_token_id!r}")
    for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None and not isinstance(value, int):
            raise ValueError(f"{name} must be an int or None, got {value!r}")
    return real


def canvas_layout(prompt_real: torch.Tensor, gen_length: int, opts: GenerationOptions) -> CanvasLayout:
    """The layout of rows of a (left-padded) prompt, `prompt_real` False on padding, followed by
    `gen_length` generated slots; the likelihood and the lm-eval scorer lay out their rows the same way."""
    batch = prompt_real.shape[0]
    generated = torch.ones(batch, gen_length, dtype=torch.bool, device=prompt_real.device)
    real = torch.cat([prompt_real, generated], dim=1)
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
    return CanvasLayout(real, positions, opts)


# ---------------------------------------------------------------------------- token choice
def _filter_logits(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """-inf outside the top-k tokens and outside the top-p nucleus (the best token always stays)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64's finaliser folded over them)."""
    state = 0
    for value in values:
        state = (state ^ (value & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        state = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 31
    return state >> 1


def uniform(opts: GenerationOptions, shape, device, draw: Tuple[int, ...], dtype=torch.float64) -> torch.Tensor:
    """Uniform [0, 1) draws of `shape` ([B, ...]): from the batch's generator, or with `opts.seeds` row b's
    from a stream keyed by (seeds[b], `draw`), where `draw` names the draw's place in the row's generation."""
    if opts.seeds is None:
        return torch.rand(shape, generator=opts.generator, dtype=dtype, device=device)
    generator, out = torch.Generator(device=device), torch.empty(shape, dtype=dtype, device=device)
    for row, seed in enumerate(opts.seeds):
        out[row].uniform_(generator=generator.manual_seed(_mix(seed, *draw)))
    return out


def _predict(logits: torch.Tensor, opts: GenerationOptions, draw: Tuple[int, ...]):
    """(tokens, their probability, the distribution's entropy or None) for logits [B, ..., V], in float64
    as LLaDA; `draw` keys the noise under per-row seeds (`uniform`); the entropy only with opts.entropy.

    Sampling inverts the float64 CDF of softmax(logit / T) at one uniform draw a position
    (`inverse_cdf`): exact in float64, where Gumbel-max noise in lower precision measurably
    skews the samples (LLaDA, arXiv 2409.02908), and one draw a position rather than one a
    vocabulary entry. T = 0 is the plain argmax.
    """
    unfiltered = logits.double()
    logits = _filter_logits(unfiltered, opts.top_k, opts.top_p)
    probs = logits.softmax(dim=-1)
    if opts.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        tempered = probs if opts.temperature == 1 else (logits / opts.temperature).softmax(dim=-1)
        tokens = inverse_cdf(tempered, uniform(opts, tempered.shape[:-1], tempered.device, draw))
    probability = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if opts.entropy is not None:  # the model's own distribution: the same softmax unless filters cut it
        whole = probs if logits is unfiltered else unfiltered.softmax(dim=-1)
        entropy = torch.special.entr(whole).sum(dim=-1)
    return tokens, probability, entropy


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from `probs` [..., V] (float64, unnormalised is fine) at uniforms `u` [...] in [0, 1): the
    first token whose cumulative probability exceeds u times the total. A token of probability 0 is never
    drawn (its cumulative probability equals the one before it), the last positive one included: the
    target stays below the total even where u x total rounds up to it."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[..., -1]
    target = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)


def _record_entropy(opts: GenerationOptions, commit: torch.Tensor, entropy: Optional[torch.Tensor],
                    first: int) -> None:
    """Write `entropy` [B, n] into opts.entropy's generated slots [first, first + n) where `commit`."""
    if entropy is not None:
        slots = opts.entropy[:, first:first + commit.shape[1]]
        slots.copy_(torch.where(commit, entropy.to(slots.dtype), slots))


def transfer_schedule(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's tokens to commit per step [B, steps]: floor(masked / steps) each, the remainder
    spread one by one over the first steps."""
    count = masked.sum(dim=1, keepdim=True)
    schedule = (count // steps).repeat(1, steps)
    schedule += torch.arange(steps, device=masked.device)[None, :] < (count % steps)
    return schedule


def _finish_at_eos(canvas: torch.Tensor, gen_start: int, finished: torch.Tensor, eos_token_id: int,
                   fill_id: int, mask_token_id: Optional[int]) -> torch.Tensor:
    """Apply the EOS rule of the module docstring in place; return the updated finished flags."""
    generated = canvas[:, gen_start:]
    is_eos = generated == eos_token_id
    first_eos = is_eos.int().argmax(dim=1, keepdim=True)
    slots = torch.arange(generated.shape[1], device=canvas.device)[None, :]
    newly = is_eos.any(dim=1) & ~finished
    if mask_token_id is not None:
        newly &= ~((generated == mask_token_id) & (slots <= first_eos)).any(dim=1)
    tail = newly[:, None] & (slots > first_eos)
    canvas[:, gen_start:] = generated.masked_fill(tail, fill_id)
    return finished | newly


# ---------------------------------------------------------------------------- diffusion
class _DiffusionSampler:
    """One LLaDA-style generation over a batch; the canvas is updated in place."""

    def __init__(self, model_fn: ModelFn, canvas: torch.Tensor, layout: CanvasLayout, prompt_length: int,
                 shift: bool, mask_token_id: int, eos_token_id: Optional[int], fill_id: Optional[int],
                 stages=None) -> None:
        self.model_fn, self.canvas, self.opts, self.stages = model_fn, canvas, layout.opts, stages
        self.prompt_length, self.shift = prompt_length, int(shift)
        self.mask_token_id, self.eos_token_id, self.fill_id = mask_token_id, eos_token_id, fill_id
        self.mask_column = torch.tensor([mask_token_id], device=canvas.device)  # made once: no copy per step
        self.finished = torch.zeros(canvas.shape[0], dtype=torch.bool, device=canvas.device)
        self.prompt_slots = layout.real.clone()
        self.prompt_slots[:, prompt_length:] = False
        # CFG runs the conditional and the unconditional rows as one doubled batch.
        self.run_layout = layout.repeat(2) if self.opts.cfg_scale > 0 else layout
        self.cache = KVCache(None, canvas.shape[1]) if self.opts.cache else None
        self.block_diffusion = self.opts.attention_mask_type == "block_diffusion"
        # Block diffusion: the model's blocks start at positions k * B; the prompt's last, partial one
        # (its `prompt_offset` tokens) is denoised with the generated slots that complete it.
        prompt_tokens = int(layout.real[0, :prompt_length].sum()) if prompt_length else 0
        self.prompt_offset = prompt_tokens % self.opts.attention_block_size if self.block_diffusion else 0
        self.committed_start = self.block_start = 0
        """Block diffusion: the first slot of the last committed block (its clean k/v are not cached yet)
        and of the block being denoised."""

    def run(self) -> torch.Tensor:
        for block_start, start, end in self._blocks():
            self.block_start = block_start
            self._denoise_block(start, end)
            self.committed_start = block_start
            if self.finished.all():
                break
        return self.canvas

    def _blocks(self):
        """(first slot of the block, first slot to denoise, end) of each block: LLaDA's semi-autoregressive
        blocks of block_length, or under block diffusion the model's own blocks, whose first one may
        hold the prompt's last tokens and whose last one may be cut."""
        opts, total = self.opts, self.canvas.shape[1]
        if not self.block_diffusion:
            for block in range(opts.gen_length // opts.block_length):
                start = self.prompt_length + block * opts.block_length
                yield start, start, start + opts.block_length
            return
        block_start, start = self.prompt_length - self.prompt_offset, self.prompt_length
        while start < total:
            end = min(block_start + opts.attention_block_size, total)
            yield block_start, start, end
            block_start = start = end

    def _denoise_block(self, start: int, end: int) -> None:
        opts = self.opts
        if self.block_diffusion:  # the steps spread over the generated tokens, at least one a block
            steps = max(1, -(-opts.steps * (end - start) // opts.gen_length))
        else:
            steps = opts.steps // (opts.gen_length // opts.block_length)
        schedule = transfer_schedule(self.canvas[:, start:end] == self.mask_token_id, steps)
        step = 0
        # Steps that would commit nothing (schedule 0 once the block is full) are skipped.
        while (self.canvas[:, start:end] == self.mask_token_id).any():
            if opts.threshold is None and step == steps:
                break
            logits = self._block_logits(start, end, first_step=step == 0)
            if self.stages is None or self.stages.decides:
                self._commit(logits, start, end, step, None if opts.threshold is not None else schedule[:, step])
            if self.stages is not None:  # every stage takes the last one's decisions
                self.stages.share(self.canvas, self.finished)
            step += 1

    def _commit(self, logits: torch.Tensor, start: int, end: int, step: int, count: Optional[torch.Tensor]) -> None:
        """One step's decisions: draw the block's tokens, commit `count` a row (or the threshold's), apply EOS."""
        opts = self.opts
        place = start - self.prompt_length, step  # the draw's place in a row's generation
        tokens, confidence, entropy = _predict(logits, opts, (*place, 0))
        if opts.remasking == "random":
            confidence = self._random_scores(start, end, place)
        masked = self.canvas[:, start:end] == self.mask_token_id
        commit = _select(confidence, masked, count, opts.threshold)
        self.canvas[:, start:end] = torch.where(commit, tokens, self.canvas[:, start:end])
        _record_entropy(opts, commit, entropy, start - self.prompt_length)
        if self.eos_token_id is not None:
            self.finished = _finish_at_eos(self.canvas, self.prompt_length, self.finished, self.eos_token_id,
                                           self.fill_id, self.mask_token_id)

    def _random_scores(self, start: int, end: int, place: Tuple[int, int]) -> torch.Tensor:
        """Random remasking's scores of the block: with a generator drawn over the whole canvas in
        float32, as LLaDA does, so a fixed generator reproduces LLaDA's choices; with per-row seeds
        over the block only (the canvas width depends on the batch's longest prompt)."""
        if self.opts.seeds is not None:
            return uniform(self.opts, (self.canvas.shape[0], end - start), self.canvas.device, (*place, 1))
        scores = torch.rand(self.canvas.shape, generator=self.opts.generator, device=self.canvas.device)
        return scores[:, start:end].double()

    def _block_logits(self, start: int, end: int, first_step: bool) -> torch.Tensor:
        """Logits predicting canvas slots [start, end) (read one slot earlier in the shift mode).

        Without a cache every step runs the whole canvas (LLaDA). With one, the first step
        of a block runs the whole canvas and refreshes every slot of the cache; later steps
        run [start, end of canvas) (prefix) or the block (dual) against it, from start - 1
        in the shift mode.
        """
        first_needed = start - self.shift
        if self.block_diffusion:
            q0, q1 = self._block_diffusion_window(first_step), end
        elif self.cache is None or first_step:
            q0, q1 = 0, self.canvas.shape[1]
        else:
            q0 = first_needed
            q1 = end if self.opts.cache == "dual" else self.canvas.shape[1]
        ids = self.canvas
        if self.opts.cfg_scale > 0:
            # Unconditional input: the prompt replaced by mask tokens, length preserved.
            ids = torch.cat([ids, ids.masked_fill(self.prompt_slots, self.mask_token_id)])
        logits = _call_model(self.model_fn, ids, self.run_layout, q0, q1, self.cache)
        if logits is None:  # a pipeline stage before the last
            return None
        # Only the block's positions go to fp32: the rest of the canvas is not needed.
        logits = logits[:, first_needed - q0:end - self.shift - q0].float()
        if self.opts.cfg_scale > 0:
            logits = guided(*logits.chunk(2), self.opts.cfg_scale)
        # Committing the mask token would leave the slot masked forever; a trained model
        # gives it ~0 probability, so ruling it out changes nothing there.
        return logits.index_fill(-1, self.mask_column, float("-inf"))


    def _block_diffusion_window(self, first_step: bool) -> int:
        """First slot a block-diffusion step runs (to the block's end): without a cache the clean
        prefix and the block; with one, the block, plus at its first step the block committed last,
        whose clean k/v (block-causal, as training's clean half) go into the cache once and exactly.
        Later blocks are never attended (block-causal mask), so what is beyond `end` does not matter."""
        if self.cache is None:
            return 0
        return self.committed_start if first_step else self.block_start


def guided(conditional: torch.Tensor, unconditional: torch.Tensor, scale: float) -> torch.Tensor:
    """LLaDA's classifier-free guidance, un + (w + 1)(cond - un). A token both rows rule out (-inf, as
    the vocabulary padding is) stays ruled out: the formula alone would make it -inf - -inf = NaN."""
    logits = unconditional + (scale + 1) * (conditional - unconditional)
    return logits.masked_fill(conditional.isneginf(), float("-inf"))


def _select(confidence: torch.Tensor, masked: torch.Tensor, count: Optional[torch.Tensor],
            threshold: Optional[float]) -> torch.Tensor:
    """Which masked slots [B, n] to commit: the `count` most confident per row (LLaDA's
    schedule), or every one above `threshold` plus the most confident (Fast-dLLM). Whole-batch
    tensor operations: no per-row loop and no host synchronisation."""
    confidence = confidence.masked_fill(~masked, float("-inf"))
    if threshold is not None:
        best = _one_hot(confidence.argmax(dim=1), masked.shape[1])
        return masked & ((confidence > threshold) | best)
    # A slot's rank in its row (0 = most confident); the first `count` ranks are committed.
    # Never more than the row still has: finished rows (EOS) have no masks left.
    order = confidence.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(masked.shape[1], device=order.device)
                                             .expand_as(order).contiguous())
    return masked & (ranks < count[:, None])


def _one_hot(index: torch.Tensor, size: int) -> torch.Tensor:
    """[B] indices -> [B, size] bool, True at each row's index."""
    return torch.arange(size, device=index.device)[None, :] == index[:, None]


# ---------------------------------------------------------------------------- autoregressive
def _decode_autoregressive(model_fn: ModelFn, canvas: torch.Tensor, layout: CanvasLayout, prompt_length: int,
                           eos_token_id: Optional[int], fill_id: Optional[int], stages=None) -> torch.Tensor:
    """Greedy / sampled next-token decoding: prefill the prompt, then one token per step."""
    opts = layout.opts
    cache = KVCache(None, canvas.shape[1]) if opts.use_cache else None
    finished = torch.zeros(canvas.shape[0], dtype=torch.bool, device=canvas.device)
    for index in range(prompt_length, canvas.shape[1]):
        # Without a cache, the whole prefix every step; with one, the prompt once, then the
        # last token only. The logits at index - 1 predict the token at index.
        q0 = 0 if cache is None or index == prompt_length else index - 1
        logits = _call_model(model_fn, canvas, layout, q0, index, cache)
        if stages is None or stages.decides:
            tokens, _, entropy = _predict(logits[:, -1].float(), opts, (index - prompt_length,))
            _record_entropy(opts, ~finished[:, None], None if entropy is None else entropy[:, None],
                            index - prompt_length)
            if eos_token_id is not None:
                tokens = tokens.masked_fill(finished, fill_id)
                finished = finished | (tokens == eos_token_id)
            canvas[:, index] = tokens
        if stages is not None:  # every stage takes the last one's decisions
            stages.share(canvas, finished)
        if eos_token_id is not None and finished.all():
            canvas[:, index + 1:] = fill_id
            break
    return canvas


# ---------------------------------------------------------------------------- entry point
@torch.no_grad()
def generate(model_fn: ModelFn, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             running_mode: str, mask_token_id: Optional[int] = None, eos_token_id: Optional[int] = None,
             pad_token_id: Optional[int] = None, stages=None, **options) -> torch.Tensor:
    """Generate ``gen_length`` tokens after each (left-padded) prompt; returns
    ``[B, prompt_length + gen_length]``, the prompts included.

    ``running_mode``: difflm-noshift / difflm-shift (diffusion sampling) or vanilla (AR).
    ``options``: the `GenerationOptions` fields, under LLaDA's names (gen_length, steps,
    block_length, cfg_scale) or MegaDLMs' (max_new_tokens, sample_steps,
    inference_block_size, cfg). Everything is validated before the model is called. ``stages``: the
    pipeline's stages (module docstring).
    """
    opts = resolve_options(running_mode, **options)
    prompt_real = _check_inputs(input_ids, attention_mask, running_mode, mask_token_id, eos_token_id,
                                pad_token_id)
    batch, prompt_length = input_ids.shape
    if opts.seeds is not None and len(opts.seeds) != batch:
        raise ValueError(f"{len(opts.seeds)} seeds for {batch} prompts: give one seed a row")
    if opts.entropy is not None and (tuple(opts.entropy.shape) != (batch, opts.gen_length)
                                     or not opts.entropy.is_floating_point()):
        raise ValueError(f"entropy must be a float [{batch}, {opts.gen_length}] tensor (prompts, gen_length), got "
                         f"{tuple(opts.entropy.shape)} {opts.entropy.dtype}")
    fill_id = pad_token_id if pad_token_id is not None else eos_token_id
    layout = canvas_layout(prompt_real.to(input_ids.device), opts.gen_length, opts)
    placeholder = mask_token_id if running_mode != "vanilla" else (fill_id if fill_id is not None else 0)
    generated = torch.full((batch, opts.gen_length), placeholder, dtype=torch.long, device=input_ids.device)
    canvas = torch.cat([input_ids.long(), generated], dim=1)
    if running_mode == "vanilla":
        canvas = _decode_autoregressive(model_fn, canvas, layout, prompt_length, eos_token_id, fill_id, stages)
    elif opts.attention_mask_type != "block_diffusion":
        canvas = _DiffusionSampler(model_fn, canvas, layout, prompt_length, running_mode == "difflm-shift",
                                   mask_token_id, eos_token_id, fill_id, stages).run()
    else:
        _block_diffusion_groups(model_fn, canvas, layout, prompt_real, prompt_length, mask_token_id, eos_token_id,
                                fill_id, stages)
    if stages is not None and opts.entropy is not None:
        stages.share(opts.entropy)
    return canvas


def _block_diffusion_groups(model_fn: ModelFn, canvas: torch.Tensor, layout: CanvasLayout, prompt_real: torch.Tensor,
                            prompt_length: int, mask_token_id: int, eos_token_id: Optional[int],
                            fill_id: Optional[int], stages) -> None:
    """Block diffusion into `canvas` in place, the rows grouped by where their blocks start."""
    opts = layout.opts
    # The model's blocks start at multiples of B from each row's first token: rows whose prompts
    # differ in length modulo B have their block boundaries at other slots, so they run apart.
    offsets = prompt_real.sum(dim=1) % opts.attention_block_size
    for offset in offsets.unique().tolist():
        rows = (offsets == offset).nonzero()[:, 0].to(canvas.device)
        seeds = None if opts.seeds is None else tuple(opts.seeds[row] for row in rows.tolist())
        entropy = None if opts.entropy is None else opts.entropy[rows]
        part = CanvasLayout(layout.real[rows], layout.positions[rows],
                            dataclasses.replace(opts, seeds=seeds, entropy=entropy))
        canvas[rows] = _DiffusionSampler(model_fn, canvas[rows], part, prompt_length, False, mask_token_id,
                                         eos_token_id, fill_id, stages).run()
        if entropy is not None:
            opts.entropy[rows] = entropy
