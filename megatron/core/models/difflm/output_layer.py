"""OutputLayer: the language-model head of GPTModel, from the last hidden states to logits or a loss.

It owns what lies between the final norm and a number: the sequence-parallel gather, the
projection onto this rank's vocabulary slice, the vocabulary padding (never predicted, so the
loss does not depend on the tensor-parallel layout), and the two cross-entropy paths, full
logits (`vocab_parallel_cross_entropy`) or only the positions with a loss weight, in chunks
(`linear_cross_entropy`, DLMConfig.masked_only_loss).

It holds no parameter. The weight is an argument of every call: the word embedding when tied,
the untied `GPTModel.output_layer` otherwise, both left where Megatron's layout puts them, so
checkpoint keys (`embedding.word_embeddings.weight`, `output_layer.weight`) and the Hugging Face
mapping do not change, and the weight read is always the live one (FSDP2 swaps parameters,
loading may assign new ones).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from megatron.core.tensor_parallel import (ColumnParallelLinear, copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           gather_from_tensor_model_parallel_region, group_rank, group_size,
                                           vocab_parallel_confident_entropy, vocab_parallel_cross_entropy)
from megatron.core.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from megatron.core.tensor_parallel.tied_gradient import TiedGradient
from megatron.core.transformer.init import parameter_seed
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig


def untied_output_layer(config: TransformerConfig, tp_group=None, sequence_parallel: bool = False) -> nn.Module:
    """The output layer's own weight when embeddings are untied: a column-parallel linear holding
    this rank's [V / tp, h] slice, kept by GPTModel as `output_layer` (Megatron's checkpoint key)."""
    return ColumnParallelLinear(
        config.hidden_size, config.vocab_size, tp_group=tp_group, sequence_parallel=sequence_parallel,
        init_std=config.init_method_std, init_seed=parameter_seed(-1, "output_layer"),
        params_dtype=config.params_dtype, fp32_weight_grad=config.gradient_accumulation_fusion)


class LossTargets(NamedTuple):
    """What the loss needs from the labels' side, known before the decoder runs (`loss_targets`)."""
    weights: torch.Tensor  # fp32 [b, s], 0 where no loss is taken
    normalizer: torch.Tensor
    shift: bool  # difflm-shift: the loss of target position j uses the hidden state at j - 1
    selected: Optional[Tuple[torch.Tensor, torch.Tensor]]  # (rows, positions) of the masked-only path
    confidence: Optional[torch.Tensor] = None  # fp32 [b, s]: the confidence loss's weight a label position


class OutputLayer(MegatronModule):
    """Logits and losses from hidden states [s, b, h] ([s/tp, b, h] under sequence parallelism).

    `weight` is this rank's [V / tp, h] slice of the output layer (see the module docstring).
    """

    def __init__(self, config: TransformerConfig, dlm_config: DLMConfig, tp_group=None) -> None:
        super().__init__(config)
        self.dlm_config = dlm_config
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[b, s, V] logits of every vocabulary entry (padding -inf), in the compute dtype."""
        return self.full_vocabulary(self._logits(hidden, weight))

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[b, s, V / tp] logits of this rank's vocabulary slice, in the compute dtype."""
        with self._autocast(hidden.device):
            return self.local_logits(hidden, weight).transpose(0, 1)

    def local_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[s, b, V / tp]: this rank's vocabulary slice; the loss never gathers the full vocabulary.
        Under the caller's autocast (the decoder's, in inference)."""
        return nn.functional.linear(self._input(hidden), weight)

    def full_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of every vocabulary entry (gathered over tp) from [..., V / tp] local ones."""
        return gather_from_tensor_model_parallel_region(self._without_padding(logits), self.tp_group)

    def _input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's input on every tp rank, as a column-parallel linear takes it: all-gathered
        from sequence-parallel slices (gradients reduce-scattered) or copied (gradients all-reduced)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden, self.tp_group, tensor_parallel_output_grad=True)
        return copy_to_tensor_model_parallel_region(hidden, self.tp_group)

    def _without_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf at the vocabulary padding columns of this rank's slice: the padding (a multiple of
        tp) is never predicted, and the loss does not depend on the parallel layout."""
        vocab = self.config.unpadded_vocab_size
        if vocab is None or vocab >= self.config.vocab_size:
            return logits
        local = logits.shape[-1]
        first = group_rank(self.tp_group) * local
        valid = max(0, min(local, vocab - first))
        if valid == local:
            return logits
        padding = torch.arange(local, device=logits.device) >= valid
        return logits.masked_fill(padding, float("-inf"))

    # ------------------------------------------------------------------ loss
    def loss_targets(self, labels: torch.Tensor, loss_weights: Optional[torch.Tensor],
                     loss_normalizer: Optional[torch.Tensor], shift: bool,
                     confidence: Optional[torch.Tensor] = None) -> LossTargets:
        """The fp32 weights, the normalizer and, for the masked-only path, the selected positions;
        `confidence`, the confidence-aware loss's weights [b, s] (DLMConfig.confidence_loss_weight).

        GPTModel calls this before the decoder runs: the selection's count is the masked-only loss's
        one host sync, and taken there it waits only for the previous step's tail, after which the
        host queues the whole decoder ahead of the GPU. Taken at the loss, the GPU would idle through
        the host's loss work (eager ops, a new GEMM shape every step), 2.5 ms in some DLM steps."""
        weights = (torch.ones(labels.shape, dtype=torch.float32, device=labels.device) if loss_weights is None
                   else loss_weights.to(torch.float32))
        if shift:
            # Target position j is predicted by the hidden state at j - 1; position 0 has no predictor.
            weights = weights.clone()
            weights[:, 0] = 0.0
        if loss_normalizer is None:
            loss_normalizer = (weights != 0).sum().clamp(min=1)
        # Weights that need a gradient (rare) keep the full path, which gives them one.
        selected = None
        if self.dlm_config.masked_only_loss and not (loss_weights is not None and loss_weights.requires_grad):
            selected = weights.nonzero(as_tuple=True)
        if confidence is not None and shift:
            confidence = confidence.clone()
            confidence[:, 0] = 0.0
        return LossTargets(weights, loss_normalizer, shift, selected, confidence)

    def loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, targets: LossTargets,
             weight_low: Optional[torch.Tensor] = None,
             tied: Optional[TiedGradient] = None) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(per-token loss [b, s], sum(per-token loss * weights) / normalizer, confidence term) from the
        last hidden states and `loss_targets`' answer for these labels; the loss includes the confidence
        term, sum(confidence weight * entropy at correct predictions) / normalizer (None without
        targets.confidence). `weight_low`: the weight's working copy in the compute dtype, which the
        masked-only path reads instead of casting `weight`; `tied`: the tied embedding's gradient
        hand-over (tensor_parallel/tied_gradient.py), used by that path."""
        batch = hidden.shape[1]
        seq = hidden.shape[0] * (group_size(self.tp_group) if self.sequence_parallel else 1)
        if labels.shape != (batch, seq):
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the batch {(batch, seq)}")
        confidence = None
        if targets.selected is not None:
            per_token, loss_sum = self._selected_positions_loss(hidden, weight, labels, targets, weight_low, tied)
        else:
            per_token, confidence = self._full_logits_loss(hidden, weight, labels, targets.shift, targets.confidence)
            loss_sum = (per_token * targets.weights).sum()
        if confidence is None:
            return per_token, loss_sum / targets.normalizer, None
        return per_token, (loss_sum + confidence) / targets.normalizer, confidence.detach() / targets.normalizer

    def _full_logits_loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shift: bool,
                          confidence: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(per-token fp32 cross-entropy [b, s] at every position, from the logits of all of them; the
        confidence-aware sum, `confidence`-weighted entropies at the correctly predicted positions)."""
        logits = self._logits(hidden, weight)
        if shift:
            logits, targets = logits[:, :-1], labels[:, 1:]
        else:
            targets = labels
        # fp32 cross-entropy: bf16 log-softmax over a large vocabulary is too coarse.
        logits = self._without_padding(logits.float())
        if group_size(self.tp_group) > 1:
            # The labels were checked on entry (TransformerConfig.check_token_ids): no second sync here.
            ce = vocab_parallel_cross_entropy(logits, targets, self.tp_group, check_targets=False)
        else:
            ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction="none").view(targets.shape)
        confident = None
        if confidence is not None:  # LLaDA 2.0's CAP: sharpen only what is already right
            entropy, correct = vocab_parallel_confident_entropy(logits, targets, self.tp_group)
            confident = (entropy * correct * (confidence[:, 1:] if shift else confidence)).sum()
        return (nn.functional.pad(ce, (1, 0)) if shift else ce), confident

    def _selected_positions_loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 targets: LossTargets, weight_low: Optional[torch.Tensor] = None,
                                 tied: Optional[TiedGradient] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(per-token loss [b, s], weighted sum) with the output layer applied only where the weight is
        nonzero, in chunks (DLMConfig.masked_only_loss). Every tp rank holds the same weights, so
        all select the same positions and run the same collectives."""
        rows, positions = targets.selected
        weights = targets.weights
        selected = self._input(hidden)[positions - int(targets.shift), rows]
        losses, loss_sum = linear_cross_entropy(
            selected, weight, labels[rows, positions], weights[rows, positions], self.tp_group,
            unpadded_vocab_size=self.config.unpadded_vocab_size, compute_dtype=self.config.compute_dtype,
            chunk_size=self.dlm_config.loss_chunk_size, compiled=self.dlm_config.compile_loss,
            weight_low=weight_low, tied=tied, triton_kernel=self.dlm_config.loss_kernel == "triton")
        per_token = losses.new_zeros(labels.shape).index_put((rows, positions), losses)
        return per_token, loss_sum
