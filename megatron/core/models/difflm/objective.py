"""The training objective: what a clean batch becomes before the model scores it.

`loss_inputs` is the one path from a clean batch and its corruption key to (the ids the model
sees, the loss weight of every label position, the normalizer). pretrain_difflm.forward_step
trains with it (and so does the training benchmark, tools/benchmark/train_throughput.py, which
times the trainer's step); `compute_loss` (GPTModel.compute_loss: the examples) and
tools/weights_conversion/verify_correctness_dlm.py score with it, so what they check is what
training optimises. In the DLM modes it
corrupts the batch (diffusion.corrupt, keyed by where each row sits in its stream) and weights
the masked positions (diffusion.loss_weights); in vanilla the weights are the loss mask.

Every rule here reads only the DLMConfig (the running mode and the diffusion options), never the
model: the data side applies them without reaching through a data-parallel wrapper.

The callers differ in two conventions, each kept on purpose:
- the normalizer: training sums the normalizers of every micro-batch and replica and divides
  once (megatron/core/distributed/loss_normalization.py), so forward_step passes
  clamp_normalizer=False; `compute_loss` scores one batch on its own and clamps it to >= 1 (a
  batch without a loss token gives 0, not 0/0).
- AR labels: get_batch reads s + 1 tokens and slices labels = tokens[:, 1:s + 1] (Megatron's
  convention); `compute_loss`, given only [b, s] ids, takes the ids shifted left by one and
  gives the last position no loss (`next_token_labels`). Both train position i on token i + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Protocol, Tuple

import torch

from megatron.core.models.difflm import block_diffusion, diffusion
from megatron.core.models.difflm.batch import VOCAB_FIX, check_id_ranges
from megatron.core.models.difflm.diffusion import Corruption, CorruptionKey
from megatron.core.transformer.moe.moe_layer import set_aux_loss_scale
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

__all__ = ["LossOutput", "LossInputs", "ScoredModel", "Corruption", "CorruptionKey", "maskable_positions",
           "output_layer_positions", "default_corruption_key", "loss_inputs", "auxiliary_terms", "loss_parts",
           "joint_ar_weights", "confidence_weights",
           "next_token_labels",
           "difflm_forward_process", "compute_loss"]


class ScoredModel(Protocol):
    """What `compute_loss` and `difflm_forward_process` use of a model (GPTModel, which calls them
    from its methods of the same names); described here so the objective does not import the model."""

    config: TransformerConfig
    dlm_config: DLMConfig
    routers: List[TopKRouter]

    def check_inputs(self, input_ids, position_ids=None, labels=None) -> None: ...

    def difflm_forward(self, input_ids, position_ids=None, labels=None, loss_weights=None, loss_normalizer=None,
                       document_ids=None, decoder_input=None, *, checked: bool = False, ar_loss_weights=None): ...

    def vanilla_forward(self, input_ids, position_ids=None, labels=None, loss_weights=None, loss_normalizer=None,
                        document_ids=None, decoder_input=None): ...


@dataclass
class LossOutput:
    """Everything `compute_loss` produced, for logging and for global normalisation."""

    loss: torch.Tensor
    """loss_sum / normalizer."""
    loss_sum: torch.Tensor
    """Sum of weighted per-token losses; summed over micro-batches and ranks before dividing."""
    normalizer: torch.Tensor
    """Denominator of this batch (valid tokens, masked tokens or sequences)."""
    per_token_loss: torch.Tensor
    """Unweighted cross-entropy [b, s] at the label positions (0 where there is no target, and with
    DLMConfig.masked_only_loss wherever the loss weight is 0)."""
    corruption: Optional[Corruption] = None
    """The corrupted batch (DLM modes)."""
    terms: Dict[str, torch.Tensor] = field(default_factory=dict)
    """The loss's auxiliary terms by name (`auxiliary_terms`: the joint objective's next-token term, the
    confidence-aware term), each included in `loss`."""


class LossInputs(NamedTuple):
    """What `loss_inputs` makes of a clean batch (unpacks as a tuple)."""

    model_input: torch.Tensor
    """The ids the model sees: corrupted in the DLM modes, the clean ids in vanilla."""
    weights: torch.Tensor
    """float32 [b, s]: the loss weight of each label position (0: no loss there)."""
    normalizer: torch.Tensor
    """0-dim float32: what the weighted loss sum is divided by."""
    corruption: Optional[Corruption]
    """The corrupted batch (DLM modes; None in vanilla)."""


def maskable_positions(input_ids: torch.Tensor, dlm: DLMConfig,
                       loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Positions the corruption may touch: the loss mask, minus position 0 in the shift
    mode (nothing predicts it) and with ignore_bos (BD3-LM: the first token stays clean)."""
    maskable = (torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool().clone())
    if _first_position_stays_clean(dlm):
        maskable[:, 0] = False
    return maskable


def _first_position_stays_clean(dlm: DLMConfig) -> bool:
    return dlm.model_running_mode == "difflm-shift" or dlm.ignore_bos


def output_layer_positions(dlm: DLMConfig, seq_length: int) -> float:
    """Expected positions of a `seq_length` row (block diffusion: of its L noisy tokens) at which the
    output layer runs: all of them, or under DLMConfig.masked_only_loss in the DLM modes the masked
    ones, E[p] (diffusion.expected_mask_probability) of the maskable positions; the joint AR + DLM
    objective adds the L - 1 clean positions carrying the next-token loss. Counted at nominal
    length with every position a loss position (no padding, prompt or --eod-mask-loss), as Megatron
    counts padded tokens; vanilla's masked-only path runs at every loss position, so at all of them."""
    ar_positions = seq_length - 1 if dlm.causal_clean_half else 0  # the joint objective's next-token loss
    if not (dlm.is_diffusion and dlm.masked_only_loss):
        return float(seq_length + ar_positions)
    maskable = seq_length - 1 if _first_position_stays_clean(dlm) else seq_length  # as maskable_positions
    return maskable * diffusion.expected_mask_probability(dlm) + ar_positions


def default_corruption_key(input_ids: torch.Tensor, dlm: DLMConfig) -> CorruptionKey:
    """The key of a batch scored outside training: its rows as samples 0..b-1 of iteration 0,
    seeded by DLMConfig.seed, so the same batch always draws the same masks."""
    batch = input_ids.shape[0]
    return CorruptionKey.for_batch(dlm.seed, iteration=0, global_batch_size=batch,
                                   first_sample_index=0, batch_size=batch, device=input_ids.device)


def _corrupt_batch(input_ids: torch.Tensor, dlm: DLMConfig, key: Optional[CorruptionKey],
                   loss_mask: Optional[torch.Tensor], document_ids: Optional[torch.Tensor]) -> Corruption:
    key = key or default_corruption_key(input_ids, dlm)
    return diffusion.corrupt(input_ids, dlm, key, maskable_positions(input_ids, dlm, loss_mask), document_ids)


def loss_inputs(input_ids: torch.Tensor, dlm: DLMConfig, key: Optional[CorruptionKey] = None,
                loss_mask: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None, *,
                clamp_normalizer: bool) -> LossInputs:
    """Clean batch + corruption key -> (model input, loss weights, normalizer, corruption).

    `loss_mask` marks the label positions that may carry a loss (padding, EOD under
    --eod-mask-loss); the DLM modes never mask nor count the others. `key` defaults to
    `default_corruption_key`; vanilla ignores it. `clamp_normalizer`: see the module docstring
    (False in training, which normalises the global batch; True to score one batch alone).
    """
    if not dlm.is_diffusion:
        weights = torch.ones_like(input_ids, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        normalizer = weights.sum()
        if clamp_normalizer:
            normalizer = normalizer.clamp(min=1)
        return LossInputs(input_ids, weights, normalizer, None)
    corruption = _corrupt_batch(input_ids, dlm, key, loss_mask, document_ids)
    weights, normalizer = diffusion.loss_weights(corruption, dlm, corruption.maskable,
                                                 clamp_normalizer=clamp_normalizer)
    return LossInputs(corruption.noisy_input_ids, weights, normalizer, corruption)


def auxiliary_terms(dlm: DLMConfig) -> Tuple[str, ...]:
    """The names of the terms the model adds to the diffusion loss, in the order it returns them: the
    joint AR + DLM objective's next-token term, LLaDA 2.0's confidence-aware term."""
    return tuple(name for name, on in (("ar loss", dlm.causal_clean_half),
                                       ("confidence loss", dlm.is_diffusion and dlm.confidence_loss_weight > 0))
                 if on)


def loss_parts(dlm: DLMConfig) -> Tuple[str, ...]:
    """The named terms the training loss adds up (GlobalBatchLoss parts): the diffusion term and the
    auxiliary ones, or none without auxiliary terms (the loss is the diffusion term)."""
    terms = auxiliary_terms(dlm)
    return ("diffusion loss", *terms) if terms else ()


def joint_ar_weights(input_ids: torch.Tensor, dlm: DLMConfig,
                     loss_mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The joint AR + DLM objective's next-token weights of a clean [b, L] batch
    (block_diffusion.ar_loss_weights under DLMConfig.ar_loss_weight; None without the joint term). Under
    the `sequence` normalizer each row's weights are divided by its count of next-token positions, as the
    diffusion term's by its maskable tokens: the term is then W times the mean over rows of each row's
    mean next-token loss."""
    if not dlm.causal_clean_half:
        return None
    weights = block_diffusion.ar_loss_weights(dlm.ar_loss_weight, loss_mask, input_ids)
    if dlm.loss_normalizer == "sequence":
        weights = weights / (weights != 0).sum(dim=1, keepdim=True).clamp(min=1)
    return weights


def confidence_weights(dlm: DLMConfig, loss_weights: Optional[torch.Tensor], query: torch.Tensor,
                       noisy_length: Optional[int] = None) -> Optional[torch.Tensor]:
    """The confidence-aware loss's weight [b, s] of the label positions a rank holds (`query`: their
    global positions): lambda where the diffusion loss is taken (block diffusion: in the noisy half,
    positions < `noisy_length`), 0 elsewhere; None without the term (DLMConfig.confidence_loss_weight)."""
    if not dlm.confidence_loss_weight:
        return None
    chosen = (torch.ones(query.shape, dtype=torch.bool, device=query.device).expand(1, -1) if loss_weights is None
              else loss_weights != 0)
    if noisy_length is not None:
        chosen = chosen & (query < noisy_length)
    return chosen.to(torch.float32) * dlm.confidence_loss_weight


def next_token_labels(input_ids: torch.Tensor,
                      loss_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(labels, loss mask) of the next-token loss when only the [b, s] ids are at hand: the ids
    shifted left by one, and no loss at the last position, which has no next token."""
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    loss_mask = torch.ones_like(input_ids, dtype=torch.float32) if loss_mask is None else loss_mask.clone()
    loss_mask[:, -1] = 0
    return labels, loss_mask


def difflm_forward_process(model: ScoredModel, input_ids: torch.Tensor, key: Optional[CorruptionKey] = None,
                           loss_mask: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None):
    """The forward (noising) process: returns (noisy_batch, masked_indices, p_mask)."""
    if not model.dlm_config.is_diffusion:
        raise ValueError("difflm_forward_process needs a difflm-* model_running_mode, not 'vanilla'")
    check_id_ranges([("input_ids", input_ids, model.config.vocab_size, VOCAB_FIX)],
                    sync=model.config.check_token_ids)
    corruption = _corrupt_batch(input_ids, model.dlm_config, key, loss_mask, document_ids)
    return corruption.noisy_input_ids, corruption.masked_positions, corruption.p_mask


def compute_loss(model: ScoredModel, input_ids: torch.Tensor, key: Optional[CorruptionKey] = None,
                 loss_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                 document_ids: Optional[torch.Tensor] = None,
                 position_ids: Optional[torch.Tensor] = None) -> LossOutput:
    """Loss of a clean batch in the model's running mode, corruption included.

    DLM modes corrupt `input_ids` with `key` and weight the loss as the DLMConfig says.
    The vanilla mode predicts `labels` (default: the next token of `input_ids`, the last
    position having no target) wherever `loss_mask` is set.
    """
    dlm = model.dlm_config
    if dlm.is_diffusion:
        # The clean ids are also the labels, and the corrupted ones add only the (validated) mask
        # token: one check of the clean batch here, none in the forward.
        model.check_inputs(input_ids, position_ids, None)
    elif labels is None:
        labels, loss_mask = next_token_labels(input_ids, loss_mask)
    model_input, weights, normalizer, corruption = loss_inputs(input_ids, dlm, key, loss_mask, document_ids,
                                                               clamp_normalizer=True)
    set_aux_loss_scale(model.routers, None)  # MoE balancing: the mean loss's own weight
    if dlm.is_diffusion:
        per_token, loss, *terms = model.difflm_forward(
            model_input, position_ids, input_ids, weights, normalizer, document_ids, checked=True,
            ar_loss_weights=joint_ar_weights(input_ids, dlm, loss_mask))
    else:
        per_token, loss = model.vanilla_forward(model_input, position_ids, labels, weights, normalizer, document_ids)
        terms = ()
    named = dict(zip(auxiliary_terms(dlm), terms[0])) if terms else {}
    return LossOutput(loss, loss * normalizer, normalizer, per_token, corruption, named)
