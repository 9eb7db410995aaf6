"""GPTModel: the decoder-only transformer of MegaDLMs, for diffusion and autoregressive LMs.

One job: embedding -> decoder -> output layer. `forward` dispatches on the running mode:
- `difflm_forward` (modes difflm-noshift and difflm-shift): the input is an already
  corrupted batch, the labels are the clean tokens at the same positions. noshift: the
  logits at position i predict token i. shift: the logits at i predict token i+1 (models
  initialised from an AR checkpoint), so the loss of target position j uses logits j-1.
- `vanilla_forward` (mode vanilla): causal attention (or a causal sliding window), labels are the next tokens
  (Megatron's data convention: tokens = text[0:L], labels = text[1:L+1]).
Per-token losses are aligned with the label positions in every mode, so the diffusion
loss weights (see diffusion.py) multiply them directly.

The corruption is not part of the forward pass: it is a pure function of a seed key that
the data side applies (objective.py: `loss_inputs`, behind `compute_loss` and
`difflm_forward_process` here), so every pipeline stage and tensor-parallel rank can derive
the same mask without communication. The embedding is embedding.py; the head (logits,
vocabulary padding, both loss paths) is output_layer.py; id checks and packing metadata are batch.py.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from megatron.core.models.difflm.sampling import SamplingMethods
from megatron.core.models.difflm import block_diffusion, objective
from megatron.core.models.difflm.batch import (check_inference_inputs, check_model_inputs, context_parallel_inputs,
                                               positions_from_documents)
from megatron.core.models.difflm.embedding import LanguageModelEmbedding
from megatron.core.models.difflm.output_layer import OutputLayer, untied_output_layer
from megatron.core.transformer.attention_mask import AttentionMask, build_attention_mask
from megatron.core.transformer.context_parallel import ContextShard
from megatron.core.parallel_state import ParallelContext, ProcessGroups
from megatron.core.tensor_parallel import group_size
from megatron.core.tensor_parallel.tied_gradient import TiedGradient
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import routers, set_aux_loss_scale
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_block import DiffLMTransformerBlock
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

ForwardResult = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class GPTModel(SamplingMethods, MegatronModule):
    """Embedding, a (slice of the) DiffLM decoder, final norm and output layer.

    `pre_process` / `post_process` say whether this pipeline stage holds the embedding /
    the output layer; `layer_range` selects its layers by global index.
    """

    def __init__(self, config: TransformerConfig, dlm_config: Optional[DLMConfig] = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: Optional[Tuple[int, int]] = None, pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config)
        self.dlm_config = dlm_config or DLMConfig(model_running_mode="vanilla")
        config.validate()
        self.dlm_config.validate(config.vocab_size, sliding_window=config.sliding_window)
        if config.moe is not None and config.moe.router_type == "expert_choice" and not self.dlm_config.is_diffusion:
            raise ValueError("MoEConfig.router_type='expert_choice' picks tokens over the whole sequence, which in "
                             "model_running_mode='vanilla' (autoregressive) depends on future tokens; use "
                             "token_choice routing or a diffusion mode")
        self.pre_process, self.post_process = pre_process, post_process
        pg = self.parallel_context(config, pg)
        self.tp_group, self.sequence_parallel, self.rng_tracker = pg.tp, pg.sequence_parallel, pg.rng_tracker
        # Context parallelism: this rank's share of every sequence (whole inputs are sliced here).
        self.context = ContextShard(pg.cp, "causal" if self.running_mode == "vanilla"
                                    else self.dlm_config.effective_mask_type)
        self.tied_output = config.share_embeddings_and_output_weights
        if pre_process or (post_process and self.tied_output):
            self.embedding = LanguageModelEmbedding(config, self.tp_group, self.rng_tracker, with_positions=pre_process)
            if self.tied_output and not (pre_process and post_process):
                self.embedding.tag_tied_across_stages(first_stage=pre_process)
        self.rotary_pos_emb = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.decoder = DiffLMTransformerBlock(config, self.dlm_config, layer_range, post_layer_norm=post_process,
                                              pg=pg)
        if post_process and not self.tied_output:
            self.output_layer = untied_output_layer(config, self.tp_group, self.sequence_parallel)
        if post_process:
            # Parameter-free: the weight stays above (or in the embedding), so checkpoint keys are Megatron's.
            self.head = OutputLayer(config, self.dlm_config, self.tp_group)
        self.routers = routers(self.decoder)
        """The MoE layers' routers (none for a dense model): each forward sets their loss scale."""
        self._graph_runner = None
        """Made by the first generate(cuda_graphs=True); holds that call's graphs for the next ones."""

    def sharded_state_dict(self, prefix: str = ""):
        """As every module's; the vocabulary tensors are marked as padded (the padding depends on tp)."""
        sharded = super().sharded_state_dict(prefix)
        for name in (f"{prefix}embedding.word_embeddings.weight", f"{prefix}output_layer.weight"):
            if name in sharded:
                sharded[name].padded_rows = True
        return sharded

    @staticmethod
    def parallel_context(config: TransformerConfig, pg: Optional[ProcessGroups]) -> ParallelContext:
        """The ParallelContext the layers are built with (ParallelContext.build)."""
        return ParallelContext.build(pg, config.sequence_parallel)

    @property
    def running_mode(self) -> str:
        return self.dlm_config.model_running_mode

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        self.decoder.set_input_tensor(input_tensor)

    # ------------------------------------------------------------------ forward paths
    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_weights: Optional[torch.Tensor] = None,
                loss_normalizer: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
                decoder_input: Optional[torch.Tensor] = None, aux_loss_scale=None,
                block_size: Optional[int] = None, ar_loss_weights: Optional[torch.Tensor] = None) -> ForwardResult:
        """Without labels: logits [b, s, V] (hidden states [s, b, h] on non-final stages).
        With labels: (per_token_loss [b, s], loss), the loss being
        sum(per_token_loss * loss_weights) / loss_normalizer (default: number of nonzero weights).
        `aux_loss_scale`: the weight of the MoE balancing losses' gradients (moe/aux_losses.py; the
        training loop passes the micro-batch's normalizer; None: 1). `block_size`: this forward's
        blocks (a block-size curriculum's current size; default DLMConfig.block_size).
        With auxiliary terms (objective.auxiliary_terms) a third value holds them, included in the loss;
        `ar_loss_weights` [b, L]: the joint objective's next-token weights (block_diffusion.joint_weights)."""
        set_aux_loss_scale(self.routers, aux_loss_scale)
        if self.running_mode == "vanilla":
            return self.vanilla_forward(input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                                        decoder_input)
        return self.difflm_forward(input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                                   decoder_input, block_size=block_size, ar_loss_weights=ar_loss_weights)

    def difflm_forward(self, input_ids, position_ids=None, labels=None, loss_weights=None,
                       loss_normalizer=None, document_ids=None, decoder_input=None, *,
                       checked: bool = False, block_size: Optional[int] = None,
                       ar_loss_weights: Optional[torch.Tensor] = None) -> ForwardResult:
        """Bidirectional (or the DLMConfig's mask, of `block_size` blocks if given); `checked`: see _forward."""
        dlm = self.dlm_config.with_block_size(block_size)
        if not checked:
            self.check_inputs(input_ids, position_ids, labels)
        if not (dlm.block_diffusion and labels is not None):
            mask_type = None
            if dlm.block_diffusion:  # logits of ids read as clean blocks (causal: a joint model's), as the HF export's
                mask_type = "causal" if dlm.causal_clean_half else "block_causal"
            return self._forward(input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                                 decoder_input, dlm, mask_type)
        # [x_t ; x_0]: 2L tokens, the diffusion loss on x_t (and a joint model's next-token loss on x_0)
        noisy_length = block_diffusion.noisy_length(input_ids, labels)
        ids, positions, labels, weights, documents = block_diffusion.model_inputs(
            input_ids, position_ids, labels, loss_weights, document_ids,
            block_diffusion.joint_weights(dlm, labels, ar_loss_weights))
        return self._forward(ids, positions, labels, weights, loss_normalizer, documents, decoder_input, dlm,
                             noisy_length=noisy_length, scores_clean=dlm.causal_clean_half)

    def vanilla_forward(self, input_ids, position_ids=None, labels=None, loss_weights=None,
                        loss_normalizer=None, document_ids=None, decoder_input=None) -> ForwardResult:
        self.check_inputs(input_ids, position_ids, labels)
        return self._forward(input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                             decoder_input, self.dlm_config, self.dlm_config.effective_mask_type, ar_mode=True)

    def _forward(self, input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                 decoder_input, dlm: DLMConfig, mask_type: Optional[str] = None, noisy_length: Optional[int] = None,
                 scores_clean: bool = False, ar_mode: bool = False) -> ForwardResult:
        """The checked inputs through the model under `dlm`'s mask (or `mask_type`). `ar_mode`: the labels
        are next tokens already (vanilla), never shifted; `noisy_length`: block diffusion's L of its
        [x_t ; x_0] input; `scores_clean`: its clean half carries the joint objective's next-token loss.
        With auxiliary terms (that one, the confidence-aware loss) their values, included in the loss,
        come third as one tensor (objective.auxiliary_terms names them)."""
        shift = self.running_mode == "difflm-shift" and not ar_mode
        positions = {}
        if self.context.active:  # whole sequences in, this rank's positions out (shift folded into labels)
            input_ids, position_ids, labels, loss_weights, *held = context_parallel_inputs(
                self.context, input_ids, position_ids, labels, loss_weights, document_ids, shift)
            positions, shift = dict(zip(("query_positions", "key_positions"), held)), False
        mask = build_attention_mask(self.config, dlm, document_ids, noisy_length=noisy_length,
                                    mask_type=mask_type, **positions)
        targets = None  # before the decoder: the masked-only loss's host sync (OutputLayer.loss_targets)
        query = confidence = None
        if self.post_process and labels is not None:
            if scores_clean or (dlm.confidence_loss_weight and not ar_mode):  # the label positions held
                query = mask.positions(labels.shape[1], device=labels.device)[0]
                confidence = objective.confidence_weights(dlm, loss_weights, query, noisy_length)
            targets = self.head.loss_targets(labels, loss_weights, loss_normalizer, shift, confidence)
        # One weight looked up and read by the loss: its two gradients are summed in place (tied_gradient.py).
        tied = TiedGradient() if targets is not None and self.tied_output and self.pre_process else None
        hidden = self._run(input_ids, position_ids, document_ids, decoder_input, mask, tied)
        if not self.post_process:
            return hidden
        if labels is None:
            return self.head.logits(hidden, self._output_weight())
        owner = self.output_weight_owner()
        per_token, loss, confidence = self.head.loss(hidden, owner.weight, labels, targets,
                                                     owner.gemm.working_copy(), tied)
        terms = []  # the auxiliary terms of the loss, in objective.auxiliary_terms' order
        if scores_clean:  # the joint objective's next-token term, on the clean half
            terms.append(block_diffusion.clean_half_loss(per_token, loss_weights, query, noisy_length,
                                                         targets.normalizer))
        if confidence is not None:
            terms.append(confidence)
        if noisy_length is not None:
            per_token = per_token[:, :noisy_length]
        return (per_token, loss, torch.stack(terms)) if terms else (per_token, loss)

    def output_weight_owner(self) -> nn.Module:
        """The module holding the output layer's weight: the word embedding when tied (last stage only)."""
        return self.embedding.word_embeddings if self.tied_output else self.output_layer

    def _output_weight(self) -> torch.Tensor:
        """This rank's [V / tp, h] slice of the output layer (the word embedding when tied), read at
        each call: FSDP2 and loading may replace the parameter objects."""
        return self.output_weight_owner().weight

    def check_inputs(self, input_ids, position_ids=None, labels=None) -> None:
        """batch.check_model_inputs under this model's config (a stage without the embedding reads no ids)."""
        check_model_inputs(self.config, input_ids, position_ids, labels, has_embedding=self.pre_process)

    def _run(self, input_ids, position_ids, document_ids, decoder_input, mask: AttentionMask,
             tied: Optional[TiedGradient] = None) -> torch.Tensor:
        """Embedding (first stage) and decoder: hidden states [s, b, h] ([s/tp, b, h] under sequence
        parallelism), after the final norm on the last stage. Ids are checked by the caller."""
        if self.pre_process:
            batch, seq = input_ids.shape
            device = input_ids.device
        else:
            hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
            if hidden is None:
                raise ValueError("a pipeline stage without the embedding needs decoder_input [s, b, h]")
            # The global length: under sequence parallelism the stage receives its s / tp slice.
            seq = hidden.shape[0] * (group_size(self.tp_group) if self.sequence_parallel else 1)
            batch, device = hidden.shape[1], hidden.device
        # Block diffusion's [x_t ; x_0] repeats the positions of its L tokens.
        span = mask.noisy_length if mask.mask_type == "block_diffusion" else seq * self.context.size
        if span > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {span} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; raise --max-position-embeddings")
        mask.validate(seq, batch, key_len=seq * self.context.size)
        if position_ids is None:
            position_ids = (positions_from_documents(document_ids) if document_ids is not None
                            else torch.arange(seq, device=device).expand(batch, seq))
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        with self._autocast(device):
            hidden = self.embedding(input_ids, tied, position_ids) if self.pre_process else hidden
            return self.decoder(hidden, mask, rotary)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def inference_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                          kv_cache=None, cache_start: int = 0,
                          select: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None,
                          decoder_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The `model_fn` of megatron.core.inference.generation: logits [b, q, V] in the compute
        dtype (bf16 under --bf16; the sampler casts only the positions it reads to fp32).

        `attention_mask` [b, q, k] bool (True = may attend) is used as given: the sampler
        builds it from absolute positions, so left padding, causality and KV-cache slots are
        its business, not the model's. With `kv_cache` every layer writes its k/v at
        [cache_start, cache_start + q) and attends the whole buffer (k == its max_length);
        without, k == q. Dropout is assumed off (call `.eval()`).

        `select`, a [b, q] bool mask or (rows, positions) index tensors: only those positions'
        logits, [n, V] as ``logits[select]``; the output layer then runs on n rows, not b * q (a
        scorer reads a few slots a row; index tensors need no host sync).

        A pipeline stage (inference/pipelined.py) runs its layers only: without the embedding it reads
        `decoder_input` [q, b, h], the previous stage's output, and before the last stage it returns its
        own output [q, b, h] instead of logits.
        """
        check_inference_inputs(self.config, input_ids, position_ids, self.context.active, self.sequence_parallel,
                               self.pre_process or decoder_input is not None)
        key_len = kv_cache.max_length if kv_cache is not None else input_ids.shape[1]
        mask = AttentionMask("explicit", allowed=attention_mask)
        mask.validate(input_ids.shape[1], input_ids.shape[0], key_len)
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        with self._autocast(input_ids.device):
            hidden = self.embedding(input_ids, position_ids=position_ids) if self.pre_process else decoder_input
            hidden = self.decoder(hidden, mask, rotary, kv_cache=kv_cache, cache_start=cache_start)
            if not self.post_process:
                return hidden
            if select is not None:  # [n, h]: the selected positions, row-major as logits[select]
                return self.head.full_vocabulary(self.head.local_logits(hidden.transpose(0, 1)[select],
                                                                        self._output_weight()))
            logits = self.head.local_logits(hidden, self._output_weight())
        return self.head.full_vocabulary(logits.transpose(0, 1))

    # ------------------------------------------------------------------ the objective (objective.py)
    def difflm_forward_process(self, input_ids: torch.Tensor, key: Optional[objective.CorruptionKey] = None,
                               loss_mask: Optional[torch.Tensor] = None,
                               document_ids: Optional[torch.Tensor] = None):
        """The forward (noising) process: returns (noisy_batch, masked_indices, p_mask)."""
        return objective.difflm_forward_process(self, input_ids, key, loss_mask, document_ids)

    def compute_loss(self, input_ids: torch.Tensor, key: Optional[objective.CorruptionKey] = None,
                     loss_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                     document_ids: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None) -> objective.LossOutput:
        """Loss of a clean batch in the model's running mode, corruption included (objective.compute_loss)."""
        return objective.compute_loss(self, input_ids, key, loss_mask, labels, document_ids, position_ids)
