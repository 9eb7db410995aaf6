"""Quality figures for generation_throughput.py: how good is the text a decoding variant writes?

- **Judge perplexity** (`--judge CKPT`): an autoregressive checkpoint of ours with the same
  vocabulary scores every generated continuation given its prompt, exactly (one causal forward,
  `likelihood.log_likelihood` in `vanilla` mode): exp of the mean negative log-likelihood per
  generated token over the batch. A faster variant whose judge perplexity stays near the
  no-cache baseline's writes text as likely as the baseline's; the same judge on the real
  continuation of the prompts gives the figure for human text. Greedy decoding without a stop
  can repeat itself, which a judge finds likely: read it beside the agreement columns.
- **Held-out likelihood** of the model under test on those real continuations: LLaDA's Monte
  Carlo ELBO for a DLM (a lower bound on log p, `--heldout-mc-num` masked copies a row), the
  exact log-likelihood for an AR model; reported in nats per token and as the perplexity it
  bounds, exp(-value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.core.inference.likelihood import log_likelihood
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.training.checkpointing import load_inference_model


class QualityError(ValueError):
    """A judge that cannot score this model's text (one line for the user)."""


@dataclass
class Judge:
    model: GPTModel
    source: str


def load_judge(path: str, device: torch.device, vocab_size: int, attention_backend: str = "auto") -> Judge:
    """The autoregressive checkpoint under `path`, checked to read the model under test's vocabulary."""
    try:
        model, metadata = load_inference_model(path, device, attention_backend)
    except ValueError as error:
        raise QualityError(f"--judge {path}: {error}") from None
    if model.running_mode != "vanilla":
        raise QualityError(f"--judge {path}: a {model.running_mode} checkpoint; the judge scores text "
                           "autoregressively, so give an AR (vanilla) checkpoint of the same tokenizer")
    if model.config.vocab_size != vocab_size:
        raise QualityError(f"--judge {path}: vocabulary {model.config.vocab_size} differs from the model's "
                           f"{vocab_size}; the judge must use the same tokenizer")
    return Judge(model.eval(), metadata["source"])


def perplexity(nats_per_token: float) -> float:
    """exp(nats per token); inf past float range (a model that has learnt nothing yet), not an error."""
    try:
        return math.exp(nats_per_token)
    except OverflowError:
        return math.inf


def _tokens(rows) -> int:
    return sum(row.numel() for row in rows)


def _causal_pattern(model: GPTModel) -> dict:
    return dict(attention_mask_type="causal", sliding_window=model.config.sliding_window)


def judge_perplexity(judge: Judge, prompts: torch.Tensor, continuations: torch.Tensor) -> float:
    """exp(mean NLL per continuation token) of [B, G] continuations (or B rows of their own lengths)
    given [B, P] prompts, under the judge."""
    total = 0.0
    for prompt, continuation in zip(prompts, continuations):
        total -= log_likelihood(judge.model.inference_forward, prompt, continuation, running_mode="vanilla",
                                **_causal_pattern(judge.model))
    return perplexity(total / _tokens(continuations))


def heldout_log_likelihood(model: GPTModel, pattern: dict, mask_token_id: int, prompts: torch.Tensor,
                           continuations: torch.Tensor, mc_num: int, seed: int) -> dict:
    """The model's log-likelihood per token of the real continuations: ELBO (DLM) or exact (AR)."""
    mode = model.running_mode
    options = _causal_pattern(model) if mode == "vanilla" else dict(pattern, mask_token_id=mask_token_id,
                                                                    mc_num=mc_num, batch_size=mc_num)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for prompt, continuation in zip(prompts, continuations):
        total += log_likelihood(model.inference_forward, prompt, continuation, running_mode=mode,
                                generator=generator, **options)
    per_token = total / _tokens(continuations)
    return {"kind": "exact log-likelihood" if mode == "vanilla" else f"Monte Carlo ELBO ({mc_num} copies a row)",
            "nats_per_token": per_token, "perplexity_bound": perplexity(-per_token), "tokens": _tokens(continuations)}
