"""Log-likelihood of an answer given a prompt: the score multiple-choice evaluation ranks.

For a diffusion LM (``difflm-noshift`` / ``difflm-shift``) the likelihood has no closed form;
this is LLaDA's Monte Carlo estimate of its evidence lower bound on the answer only (the
prompt is never masked). Each of ``mc_num`` samples masks ``l`` of the answer's ``A`` tokens,
``l`` stratified over each batch of ``batch_size`` samples (``l_i = ((k + i A / b - 1) mod A)
+ 1`` with one random offset ``k`` per batch, rounded as LLaDA rounds it), the positions
uniformly at random; the sample scores ``(A / l) * sum of the masked tokens' cross-entropy``.
The result is minus the mean score: a lower bound on log p(answer | prompt), in nats, whose
expectation over the random draws is exact. ``cfg_scale`` > 0 applies LLaDA's classifier-free
guidance to the logits (the unconditional input masks the prompt). In ``difflm-shift`` the
logits at position i score token i + 1, so the prompt must hold at least one token.

For a block-diffusion model (BD3-LM, ``attention_mask_type="block_diffusion"``) the ELBO is a sum
over the model's blocks (of ``attention_block_size`` positions, counted from the prompt's first
token) that hold answer tokens: each block's answer tokens are masked as above (``l`` of its
``A_b``, weight ``A_b / l``) while every earlier block stays clean, which is what the block sees in
training's ``[x_t ; x_0]`` input; under the block-causal mask later blocks are never attended.
One row per block and sample, all in one forward.

For an autoregressive model (``vanilla``) the log-likelihood is exact: one causal forward,
the sum of the answer tokens' log-probabilities; ``mc_num`` and ``batch_size`` are unused.

Like generation.py this file imports only torch and its neighbour, so the Hugging Face
exporter ships it with an exported model (`DLMForCausalLM.log_likelihood`). The model callable
is generation.py's ``model_fn``; the attention is the trained pattern (``attention_mask_type``
and its sizes, as for `generation.generate`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .generation import ModelFn, canvas_layout, guided, resolve_options

__all__ = ["log_likelihood", "answer_spans", "draw_masks"]


@torch.no_grad()
def log_likelihood(model_fn: ModelFn, prompt: torch.Tensor, answer: torch.Tensor, *, running_mode: str,
                   mask_token_id: Optional[int] = None, mc_num: int = 128, batch_size: int = 32,
                   cfg_scale: float = 0.0, generator: Optional[torch.Generator] = None,
                   attention_mask_type: Optional[str] = None, attention_block_size: Optional[int] = None,
                   sliding_window: Optional[int] = None, causal_clean: bool = False) -> float:
    """log p(answer | prompt) in nats (a Monte Carlo ELBO for DLMs, exact for AR); see the module doc.

    ``prompt`` [P] and ``answer`` [A] are 1-D tensors of token ids on the model's device.
    ``mc_num`` samples run ``batch_size`` at a time (``mc_num`` a multiple of it; LLaDA uses 128,
    and 1 for single-token answers). ``generator``, a CPU `torch.Generator`, draws the masks:
    the same seed gives the same estimate on any device.
    """
    for name, ids in (("prompt", prompt), ("answer", answer)):
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be a 1-D tensor of token ids, got {tuple(ids.shape)} {ids.dtype}")
    if answer.numel() == 0:
        raise ValueError("answer is empty: there is nothing to score")
    opts = resolve_options(running_mode, gen_length=answer.numel(), attention_mask_type=attention_mask_type,
                           attention_block_size=attention_block_size, sliding_window=sliding_window,
                           causal_clean=causal_clean)
    sequence = torch.cat([prompt, answer]).long()[None]
    layout = canvas_layout(torch.ones_like(prompt, dtype=torch.bool)[None], answer.numel(), opts)
    mask = layout.attention_mask(0, sequence.shape[1], sequence.shape[1])
    if running_mode == "vanilla":
        if prompt.numel() == 0:
            raise ValueError("an autoregressive model needs at least one prompt token (BOS) to score the answer")
        logits = model_fn(sequence, layout.positions, mask, None, 0)[0, prompt.numel() - 1:-1].float()
        return logits.log_softmax(dim=-1).gather(1, answer.long()[:, None]).sum().item()
    _check_diffusion(running_mode, prompt, mask_token_id, mc_num, batch_size, cfg_scale, answer)
    spans = answer_spans(prompt.numel(), sequence.shape[1], opts.attention_block_size
                         if opts.attention_mask_type == "block_diffusion" else None)
    if opts.causal_clean:  # each span's rows: the blocks before its own are clean (token-causal)
        mask = torch.cat([layout.attention_mask(0, sequence.shape[1], sequence.shape[1], noisy_from=start)
                          .expand(batch_size, -1, -1) for start, _ in spans])
    total = torch.zeros((), dtype=torch.float64, device=answer.device)
    for _ in range(mc_num // batch_size):
        total += _elbo_batch(model_fn, sequence, layout.positions, mask, spans, running_mode == "difflm-shift",
                             mask_token_id, batch_size, cfg_scale, generator)
    return -(total / (mc_num // batch_size)).item()


def answer_spans(prompt_length: int, total: int, block: Optional[int]) -> List[Tuple[int, int]]:
    """[start, end) slots masked together: the whole answer, or (block diffusion, blocks of `block`
    from slot 0) its part in each block."""
    if block is None:
        return [(prompt_length, total)]
    spans, start = [], prompt_length
    while start < total:
        end = min((start // block + 1) * block, total)
        spans.append((start, end))
        start = end
    return spans


def draw_masks(length: int, batch: int, generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(l [batch], masked [batch, length] bool) on the host: row i masks l_i of the `length` slots,
    l_i stratified over the batch with one random offset, the slots uniformly at random."""
    offset = torch.randint(1, length + 1, (), generator=generator).item()
    counts = torch.linspace(offset, offset + (batch - 1) * length / batch, batch).round().long()
    counts = ((counts - 1) % length) + 1  # l_i in [1, A], stratified over the batch
    # A random permutation rank per slot: the l_i lowest ranks are masked.
    ranks = torch.rand(batch, length, generator=generator).argsort(dim=1).argsort(dim=1)
    return counts, ranks < counts[:, None]


def _check_diffusion(running_mode: str, prompt: torch.Tensor, mask_token_id: Optional[int], mc_num: int,
                     batch_size: int, cfg_scale: float, answer: torch.Tensor) -> None:
    if not isinstance(mask_token_id, int):
        raise ValueError(f"running_mode={running_mode!r} needs mask_token_id (an int), got {mask_token_id!r}")
    for name, value in (("mc_num", mc_num), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if mc_num % batch_size:
        raise ValueError(f"mc_num={mc_num} must be a multiple of batch_size={batch_size}; LLaDA uses 128 with 8-32")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale={cfg_scale!r} must be >= 0 (0 disables guidance)")
    if running_mode == "difflm-shift" and prompt.numel() == 0:
        raise ValueError("difflm-shift scores token i with the logits at i - 1: give the prompt at least one "
                         "token (BOS)")
    if bool((prompt == mask_token_id).any()) or bool((answer == mask_token_id).any()):
        raise ValueError(f"prompt or answer holds the mask token {mask_token_id}; it cannot be scored")


def _elbo_batch(model_fn: ModelFn, sequence: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                spans: List[Tuple[int, int]], shift: bool, mask_token_id: int, batch: int, cfg_scale: float,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """Sum over `batch` samples of, for each span, (A_s / l) * CE of its l masked tokens, divided by
    `batch`; a span's rows keep every other slot clean."""
    device, width, prompt_length = sequence.device, sequence.shape[1], spans[0][0]
    masks, weights = [], []
    for start, end in spans:
        counts, drawn = draw_masks(end - start, batch, generator)
        masked = torch.zeros(batch, width, dtype=torch.bool)
        masked[:, start:end] = drawn
        masks.append(masked)
        weights.append(((end - start) / counts.double())[:, None].expand(batch, width))  # A_s / l_i
    masked, weight = torch.cat(masks).to(device), torch.cat(weights).to(device)
    targets = sequence.expand(masked.shape[0], -1)
    noisy = targets.masked_fill(masked, mask_token_id)
    ids = noisy
    if cfg_scale > 0:  # the unconditional rows: the prompt masked too
        ids = torch.cat([noisy, noisy.clone().index_fill_(1, torch.arange(prompt_length, device=device),
                                                          mask_token_id)])
    rows = ids.shape[0]
    mask = mask.expand(rows, -1, -1) if mask.shape[0] == 1 else mask.repeat(rows // mask.shape[0], 1, 1)
    logits = model_fn(ids, positions.expand(rows, -1), mask, None, 0).float()
    if cfg_scale > 0:
        logits = guided(*logits.chunk(2), cfg_scale)
    if shift:  # the logits at i score token i + 1
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    cross_entropy = F.cross_entropy(logits[masked], targets[masked], reduction="none")
    return (cross_entropy.double() * weight[masked]).sum() / batch
