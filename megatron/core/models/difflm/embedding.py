"""LanguageModelEmbedding: token ids to the decoder's input hidden states, GPTModel's first step.

The word embedding is a vocabulary-parallel table (each tp rank holds [V / tp, h]). With tied
embeddings it is also the output layer's weight (output_layer.py reads it); when pipeline stages
split the model, the last stage holds a copy of it (`tag_tied_across_stages`). With
position_embedding_type learned_absolute (Megatron-LM's GPT default) a learned position table,
whole on every tp rank, is added before the dropout, as Megatron-LM adds it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
from torch import nn

from megatron.core.tensor_parallel import VocabParallelEmbedding, group_rank, group_size
from megatron.core.tensor_parallel.layers import init_master_weight
from megatron.core.tensor_parallel.tied_gradient import TiedGradient
from megatron.core.transformer.init import parameter_seed
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class LanguageModelEmbedding(MegatronModule):
    def __init__(self, config: TransformerConfig, tp_group=None, rng_tracker=None, with_positions: bool = True) -> None:
        """`with_positions`: hold the learned position table (learned_absolute), False on a last pipeline stage
        that keeps only the tied output weight."""
        super().__init__(config)
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        self.rng_tracker = rng_tracker if self.sequence_parallel else None
        """Under sequence parallelism each tp rank embeds other tokens: their dropout draws the
        tracker's per-tp-rank stream, as the layers' hidden dropout does (transformer_layer.py)."""
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_group=tp_group, init_std=config.init_method_std,
            init_seed=parameter_seed(-1, "word_embeddings"), params_dtype=config.params_dtype,
            sequence_parallel=self.sequence_parallel)
        self.tp_group = tp_group
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute" and with_positions:
            shape = (config.max_position_embeddings, config.hidden_size)  # drawn privately: no global RNG draw
            self.position_embeddings = nn.Embedding(*shape, _weight=init_master_weight(
                shape, config.init_method_std, parameter_seed(-1, "position_embeddings"), config.params_dtype))
            # Under sequence parallelism each tp rank adds the rows of its own slice of the sequence.
            self.position_embeddings.weight.allreduce_over_tp = self.sequence_parallel

    def forward(self, input_ids: torch.Tensor, tied: Optional[TiedGradient] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[b, s] token ids (and [b, s] positions, for a learned position table) -> [s, b, h] hidden
        states ([s/tp, b, h] under sequence parallelism)."""
        embedded = self.word_embeddings(input_ids.t(), tied).contiguous()
        if self.position_embeddings is not None:
            embedded = embedded + self._positions(position_ids)
        if not self.training or self.config.hidden_dropout == 0:
            return embedded
        with self.rng_tracker.fork() if self.rng_tracker is not None else nullcontext():
            return nn.functional.dropout(embedded, p=self.config.hidden_dropout, training=True)

    def _positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The learned rows of `position_ids` [b, s] as [s, b, h] (this rank's s / tp slice under sequence
        parallelism, the word embedding's reduce-scatter slice)."""
        if position_ids is None:
            raise ValueError("a learned_absolute position table needs the position ids")
        rows = self.position_embeddings(position_ids.t())
        if self.sequence_parallel:
            rows = rows.chunk(group_size(self.tp_group), dim=0)[group_rank(self.tp_group)]
        return rows

    def tag_tied_across_stages(self, first_stage: bool) -> None:
        """Tied embeddings split over pipeline stages: the last stage holds a copy of the word
        embedding as its output weight, initialised from the same seed and saved under the same
        checkpoint key (the copies are replicas of one tensor). Both copies are tagged
        `tied_across_stages`, so their gradients are summed over the embedding group and stay
        equal; the last stage's is also `tied_embedding_copy`, so the gradient norm counts it once."""
        weight = self.word_embeddings.weight
        weight.tied_across_stages = True
        weight.tied_embedding_copy = not first_stage
