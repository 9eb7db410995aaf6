"""GPTModel: the decoder-only transformer of MegaDLMs, for diffusion and autoregressive LMs.

`forward` dispatches on the running mode:
- `difflm_forward` (modes difflm-noshift and difflm-shift): the input is an already
  corrupted batch, the labels are the clean tokens at the same positions. noshift: the
  logits at position i predict token i. shift: the logits at i predict token i+1 (models
  initialised from an AR checkpoint), so the loss of target position j uses logits j-1.
- `vanilla_forward` (mode vanilla): causal attention, labels are the next tokens
  (Megatron's data convention: tokens = text[0:L], labels = text[1:L+1]).
Per-token losses are aligned with the label positions in every mode, so the diffusion
loss weights (see diffusion.py) multiply them directly.

The corruption is not part of the forward pass: it is a pure function of a seed key that
the data side (or `difflm_forward_process`) applies, so every pipeline stage and tensor-
parallel rank can derive the same mask without communication.
"""

from __future__ import annotations

from contextlib import nullcontext
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from megatron.core.inference import generation, likelihood
from megatron.core.inference.cuda_graphs import CUDAGraphRunner, runner_for
from megatron.core.models.difflm import diffusion
from megatron.core.transformer.attention import build_attention_mask
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.parallel_state import ProcessGroups
from megatron.core.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding,
                                           copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           gather_from_tensor_model_parallel_region, group_rank, group_size,
                                           model_parallel_rng_tracker, vocab_parallel_cross_entropy)
from megatron.core.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.mlp import parameter_seed
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_block import DiffLMTransformerBlock
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

ForwardResult = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


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
    corruption: Optional[diffusion.Corruption] = None
    """The corrupted batch (DLM modes)."""


class LanguageModelEmbedding(MegatronModule):
    def __init__(self, config: TransformerConfig, tp_group=None) -> None:
        super().__init__(config)
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_group=tp_group, init_std=config.init_method_std,
            init_seed=parameter_seed(-1, "word_embeddings"), params_dtype=config.params_dtype,
            sequence_parallel=self.sequence_parallel)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [s, b, h] hidden states ([s/tp, b, h] under sequence parallelism)."""
        embedded = self.word_embeddings(input_ids.t()).contiguous()
        return nn.functional.dropout(embedded, p=self.config.hidden_dropout, training=self.training)


VOCAB_FIX = "check the tokenizer, --vocab-size and --make-vocab-size-divisible-by"
POSITION_FIX = "raise --max-position-embeddings"


IdCheck = Tuple[str, Optional[torch.Tensor], int, str]
"""(name, ids or None, exclusive upper limit, the fix to name in the error)."""


def check_id_ranges(checks: Sequence[IdCheck], sync: bool = True) -> None:
    """ValueError naming the first tensor of ids outside [0, limit), before any heavy work.

    Every min and max comes back in one transfer: one host sync for ids on an accelerator,
    none on CPU. With `sync=False` (and always inside a CUDA graph capture), ids on an
    accelerator get a device-side assert instead: no sync, and a bad id aborts the process
    with the same message a little later.
    """
    checks = [check for check in checks if check[1] is not None]
    for name, ids, _, _ in checks:
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be an integer tensor of ids, got {ids.dtype}")
    checks = [check for check in checks if check[1].numel()]
    if not checks:
        return
    device = checks[0][1].device
    # A CUDA graph being captured cannot stop for a host check: it records the device assert.
    if device.type != "cpu" and (not sync or torch.cuda.is_current_stream_capturing()):
        for name, ids, limit, fix in checks:
            torch._assert_async(((ids >= 0) & (ids < limit)).all(), f"{name} holds ids outside [0, {limit}); {fix}")
        return
    bounds = torch.stack([torch.stack(torch.aminmax(ids)).to(device=device, dtype=torch.int64)
                          for _, ids, _, _ in checks]).tolist()
    for (name, _, limit, fix), (low, high) in zip(checks, bounds):
        if low < 0 or high >= limit:
            raise ValueError(f"{name} holds values in [{low}, {high}], outside [0, {limit}); {fix}")


def check_token_ids(name: str, ids: torch.Tensor, limit: int, fix: str = VOCAB_FIX) -> None:
    """Fail with a clear message instead of an index error deep inside an embedding lookup."""
    check_id_ranges([(name, ids, limit, fix)])


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 at every document boundary of a packed row."""
    seq = document_ids.shape[1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_of_document = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_of_document


class GPTModel(MegatronModule):
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
        self.pre_process, self.post_process = pre_process, post_process
        self.tp_group = pg.tp if pg is not None else None
        self.sequence_parallel = config.sequence_parallel and group_size(self.tp_group) > 1
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.tp_group)
        self.rotary_pos_emb = RotaryEmbedding(config)
        self.decoder = DiffLMTransformerBlock(config, self.dlm_config, layer_range, post_layer_norm=post_process,
                                              pg=pg)
        self._install_rng_tracker()
        self.tied_output = config.share_embeddings_and_output_weights and pre_process
        if post_process and not self.tied_output:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.vocab_size, tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
                init_std=config.init_method_std, init_seed=parameter_seed(-1, "output_layer"),
                params_dtype=config.params_dtype)
        self._graph_runner: Optional[CUDAGraphRunner] = None
        """Made by the first generate(cuda_graphs=True); holds that call's graphs for the next ones."""

    def sharded_state_dict(self, prefix: str = ""):
        """As every module's; the vocabulary tensors are marked as padded (the padding depends on tp)."""
        sharded = super().sharded_state_dict(prefix)
        for name in (f"{prefix}embedding.word_embeddings.weight", f"{prefix}output_layer.weight"):
            if name in sharded:
                sharded[name].padded_rows = True
        return sharded

    def _install_rng_tracker(self) -> None:
        """Dropout inside tensor-parallel regions (and on sequence-parallel slices) must differ
        across tp ranks; everything else draws the default stream, identical on every rank."""
        if group_size(self.tp_group) == 1:
            return
        self.rng_tracker = model_parallel_rng_tracker(torch.initial_seed(), group_rank(self.tp_group))
        self.decoder.rng_tracker = self.rng_tracker
        for module in self.decoder.modules():
            if isinstance(module, SelfAttention) or (self.sequence_parallel and isinstance(module, TransformerLayer)):
                module.rng_tracker = self.rng_tracker

    @property
    def running_mode(self) -> str:
        return self.dlm_config.model_running_mode

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        self.decoder.set_input_tensor(input_tensor)

    # ------------------------------------------------------------------ forward paths
    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_weights: Optional[torch.Tensor] = None,
                loss_normalizer: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
                decoder_input: Optional[torch.Tensor] = None) -> ForwardResult:
        """Without labels: logits [b, s, V] (hidden states [s, b, h] on non-final stages).
        With labels: (per_token_loss [b, s], loss), the loss being
        sum(per_token_loss * loss_weights) / loss_normalizer (default: number of nonzero weights)."""
        path = self.vanilla_forward if self.running_mode == "vanilla" else self.difflm_forward
        return path(input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids, decoder_input)

    def difflm_forward(self, input_ids, position_ids=None, labels=None, loss_weights=None,
                       loss_normalizer=None, document_ids=None, decoder_input=None) -> ForwardResult:
        return self._forward(input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                             decoder_input, causal=False)

    def vanilla_forward(self, input_ids, position_ids=None, labels=None, loss_weights=None,
                        loss_normalizer=None, document_ids=None, decoder_input=None) -> ForwardResult:
        return self._forward(input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                             decoder_input, causal=True)

    def _forward(self, input_ids, position_ids, labels, loss_weights, loss_normalizer, document_ids,
                 decoder_input, causal: bool, checked: bool = False) -> ForwardResult:
        """`checked`: the caller already ran `_check_inputs` on these ids."""
        if not checked:
            self._check_inputs(input_ids, position_ids, labels)
        mask = build_attention_mask(self.config, self.dlm_config, document_ids,
                                    mask_type="causal" if causal else None)
        hidden = self._run(input_ids, position_ids, document_ids, decoder_input, mask)
        if not self.post_process:
            return hidden
        if labels is None:
            return self._full_vocabulary(self._logits(hidden))
        shift = not causal and self.running_mode == "difflm-shift"
        return self._loss(hidden, labels, loss_weights, loss_normalizer, shift=shift)

    def _check_inputs(self, input_ids, position_ids, labels) -> None:
        """Shapes and id ranges of a forward's inputs, in one host sync at most (see
        TransformerConfig.check_token_ids), so bad data fails before the decoder runs."""
        if self.pre_process and (input_ids is None or input_ids.dim() != 2):
            raise ValueError("input_ids must be a [batch, seq] tensor of token ids")
        if labels is not None and input_ids is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the batch {tuple(input_ids.shape)}")
        check_id_ranges([("input_ids", input_ids if self.pre_process else None, self.config.vocab_size, VOCAB_FIX),
                         ("position_ids", position_ids, self.config.max_position_embeddings, POSITION_FIX),
                         ("labels", labels, self.config.vocab_size, VOCAB_FIX)], sync=self.config.check_token_ids)

    def _full_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of every vocabulary entry (gathered over tp)."""
        return gather_from_tensor_model_parallel_region(self._without_padding(logits), self.tp_group)

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

    def _autocast(self, device: torch.device):
        if self.config.bf16 or self.config.fp16:
            return torch.autocast(device.type, dtype=self.config.compute_dtype)
        return nullcontext()

    def _run(self, input_ids, position_ids, document_ids, decoder_input, mask: AttentionMask) -> torch.Tensor:
        """Embedding (first stage) and decoder: hidden states [s, b, h] ([s/tp, b, h] under sequence
        parallelism), after the final norm on the last stage. Ids are checked by the caller."""
        if self.pre_process:
            batch, seq = input_ids.shape
            device = input_ids.device
        else:
            hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
            if hidden is None:
                raise ValueError("a pipeline stage without the embedding needs decoder_input [s, b, h]")
            seq, batch, device = hidden.shape[0], hidden.shape[1], hidden.device
        if seq > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {seq} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; raise --max-position-embeddings")
        mask.validate(seq, batch)
        if position_ids is None:
            position_ids = (positions_from_documents(document_ids) if document_ids is not None
                            else torch.arange(seq, device=device).expand(batch, seq))
        rotary = self.rotary_pos_emb(position_ids)
        with self._autocast(device):
            hidden = self.embedding(input_ids) if self.pre_process else hidden
            return self.decoder(hidden, mask, rotary)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, s, V / tp] logits of this rank's vocabulary slice, in the compute dtype."""
        with self._autocast(hidden.device):
            return self._local_logits(hidden).transpose(0, 1)

    def _output_weight(self) -> torch.Tensor:
        """This rank's [V / tp, h] slice of the output layer (the word embedding when tied)."""
        return self.embedding.word_embeddings.weight if self.tied_output else self.output_layer.weight

    def _output_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's input on every tp rank, as a column-parallel linear takes it: all-gathered
        from sequence-parallel slices (gradients reduce-scattered) or copied (gradients all-reduced)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden, self.tp_group, tensor_parallel_output_grad=True)
        return copy_to_tensor_model_parallel_region(hidden, self.tp_group)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s, b, V / tp]: this rank's vocabulary slice; the loss never gathers the full vocabulary."""
        if not self.tied_output:
            return self.output_layer(hidden)
        return nn.functional.linear(self._output_input(hidden), self._output_weight())

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor, loss_weights: Optional[torch.Tensor],
              loss_normalizer: Optional[torch.Tensor], shift: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """(per-token loss [b, s], sum(per-token loss * weights) / normaliser) from the last hidden states."""
        batch = hidden.shape[1]
        seq = hidden.shape[0] * (group_size(self.tp_group) if self.sequence_parallel else 1)
        if labels.shape != (batch, seq):
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the batch {(batch, seq)}")
        weights = (torch.ones(labels.shape, dtype=torch.float32, device=labels.device) if loss_weights is None
                   else loss_weights.to(torch.float32))
        if shift:
            # Target position j is predicted by the hidden state at j - 1; position 0 has no predictor.
            weights = weights.clone()
            weights[:, 0] = 0.0
        if loss_normalizer is None:
            loss_normalizer = (weights != 0).sum().clamp(min=1)
        # Weights that need a gradient (rare) keep the full path, which gives them one.
        if self.dlm_config.masked_only_loss and not (loss_weights is not None and loss_weights.requires_grad):
            per_token, loss_sum = self._selected_positions_loss(hidden, labels, weights, shift)
        else:
            per_token = self._full_logits_loss(hidden, labels, shift)
            loss_sum = (per_token * weights).sum()
        return per_token, loss_sum / loss_normalizer

    def _full_logits_loss(self, hidden: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
        """Per-token fp32 cross-entropy [b, s] at every position, from the logits of all of them."""
        logits = self._logits(hidden)
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
        return nn.functional.pad(ce, (1, 0)) if shift else ce

    def _selected_positions_loss(self, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                                 shift: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """(per-token loss [b, s], weighted sum) with the output layer applied only where the weight is
        nonzero, in chunks (DLMConfig.masked_only_loss). Every tp rank holds the same weights, so
        all select the same positions and run the same collectives."""
        # The one host sync of this path: the number of selected positions sets the shapes below.
        rows, positions = weights.nonzero(as_tuple=True)
        selected = self._output_input(hidden)[positions - int(shift), rows]
        losses, loss_sum = linear_cross_entropy(
            selected, self._output_weight(), labels[rows, positions], weights[rows, positions], self.tp_group,
            unpadded_vocab_size=self.config.unpadded_vocab_size, compute_dtype=self.config.compute_dtype,
            chunk_size=self.dlm_config.loss_chunk_size, compiled=self.dlm_config.compile_loss)
        per_token = losses.new_zeros(labels.shape).index_put((rows, positions), losses)
        return per_token, loss_sum

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def inference_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                          kv_cache=None, cache_start: int = 0) -> torch.Tensor:
        """The `model_fn` of megatron.core.inference.generation: logits [b, q, V] in the compute
        dtype (bf16 under --bf16; the sampler casts only the positions it reads to fp32).

        `attention_mask` [b, q, k] bool (True = may attend) is used as given: the sampler
        builds it from absolute positions, so left padding, causality and KV-cache slots are
        its business, not the model's. With `kv_cache` every layer writes its k/v at
        [cache_start, cache_start + q) and attends the whole buffer (k == its max_length);
        without, k == q. Dropout is assumed off (call `.eval()`).
        """
        if not (self.pre_process and self.post_process):
            raise ValueError("inference_forward needs the whole model on one stage (pre_process and post_process); "
                             "build the model for generation with pipeline_model_parallel_size=1")
        if self.sequence_parallel:
            raise ValueError("inference_forward does not support sequence parallelism; build the model for "
                             "generation with sequence_parallel=False (the weights are the same)")
        if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                             "must both be [batch, q]")
        check_id_ranges([("input_ids", input_ids, self.config.vocab_size, VOCAB_FIX),
                         ("position_ids", position_ids, self.config.max_position_embeddings, POSITION_FIX)],
                        sync=self.config.check_token_ids)
        key_len = kv_cache.max_length if kv_cache is not None else input_ids.shape[1]
        mask = AttentionMask("explicit", allowed=attention_mask)
        mask.validate(input_ids.shape[1], input_ids.shape[0], key_len)
        rotary = self.rotary_pos_emb(position_ids)
        with self._autocast(input_ids.device):
            hidden = self.embedding(input_ids)
            hidden = self.decoder(hidden, mask, rotary, kv_cache=kv_cache, cache_start=cache_start)
            logits = self._local_logits(hidden)
        return self._full_vocabulary(logits.transpose(0, 1))

    def _trained_pattern(self) -> dict:
        return dict(attention_mask_type=self.dlm_config.effective_mask_type,
                    attention_block_size=self.dlm_config.block_size, sliding_window=self.config.sliding_window)

    def log_likelihood(self, prompt: torch.Tensor, answer: torch.Tensor, **options) -> float:
        """log p(answer | prompt) for 1-D id tensors: LLaDA's Monte Carlo ELBO in the diffusion
        modes, exact for AR; options (mc_num, batch_size, cfg_scale, generator) and the method
        in megatron.core.inference.likelihood. The attention pattern is the one trained."""
        return likelihood.log_likelihood(self.inference_forward, prompt, answer, running_mode=self.running_mode,
                                         mask_token_id=self.dlm_config.mask_token_id,
                                         **(self._trained_pattern() | options))

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 cuda_graphs: bool = False, **options) -> torch.Tensor:
        """Generate in this model's running mode; see megatron.core.inference.generation.generate
        for the options (LLaDA and MegaDLMs names). The attention pattern is the one trained.

        `cuda_graphs`: replay a captured CUDA graph per forward shape (megatron.core.inference.
        cuda_graphs). The graphs stay with the model, so later calls of the same sizes reuse them
        (captured again once the weight tensors are replaced: `cuda_graphs.runner_for`)."""
        model_fn = self.inference_forward
        if cuda_graphs:
            model_fn = self._graph_runner = runner_for(self, self.inference_forward, self._graph_runner)
        return generation.generate(model_fn, input_ids, attention_mask,
                                   running_mode=self.running_mode, mask_token_id=self.dlm_config.mask_token_id,
                                   **(self._trained_pattern() | options))

    # ------------------------------------------------------------------ diffusion helpers
    def maskable_positions(self, input_ids: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Positions the corruption may touch: the loss mask, minus position 0 in the shift
        mode (nothing predicts it)."""
        maskable = (torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool().clone())
        if self.running_mode == "difflm-shift":
            maskable[:, 0] = False
        return maskable

    def default_corruption_key(self, input_ids: torch.Tensor) -> diffusion.CorruptionKey:
        batch = input_ids.shape[0]
        return diffusion.CorruptionKey.for_batch(self.dlm_config.seed, iteration=0, global_batch_size=batch,
                                                 first_sample_index=0, batch_size=batch, device=input_ids.device)

    def difflm_forward_process(self, input_ids: torch.Tensor, key: Optional[diffusion.CorruptionKey] = None,
                               loss_mask: Optional[torch.Tensor] = None,
                               document_ids: Optional[torch.Tensor] = None):
        """The forward (noising) process: returns (noisy_batch, masked_indices, p_mask)."""
        if not self.dlm_config.is_diffusion:
            raise ValueError("difflm_forward_process needs a difflm-* model_running_mode, not 'vanilla'")
        check_id_ranges([("input_ids", input_ids, self.config.vocab_size, VOCAB_FIX)], sync=self.config.check_token_ids)
        key = key or self.default_corruption_key(input_ids)
        corruption = diffusion.corrupt(input_ids, self.dlm_config, key,
                                       self.maskable_positions(input_ids, loss_mask), document_ids)
        return corruption.noisy_input_ids, corruption.masked_positions, corruption.p_mask

    def compute_loss(self, input_ids: torch.Tensor, key: Optional[diffusion.CorruptionKey] = None,
                     loss_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                     document_ids: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None) -> LossOutput:
        """Loss of a clean batch in the model's running mode, corruption included.

        DLM modes corrupt `input_ids` with `key` and weight the loss as the DLMConfig says.
        The vanilla mode predicts `labels` (default: the next token of `input_ids`, the last
        position having no target) wherever `loss_mask` is set.
        """
        if self.running_mode == "vanilla":
            weights = torch.ones_like(input_ids, dtype=torch.float32) if loss_mask is None else loss_mask.float()
            if labels is None:
                labels = torch.roll(input_ids, shifts=-1, dims=1)
                weights = weights.clone()
                weights[:, -1] = 0.0
            normalizer = weights.sum().clamp(min=1)
            per_token, loss = self.vanilla_forward(input_ids, position_ids, labels, weights, normalizer, document_ids)
            return LossOutput(loss, loss * normalizer, normalizer, per_token)
        # The clean ids are also the labels, and the corrupted ones add only the (validated) mask token.
        self._check_inputs(input_ids, position_ids, None)
        maskable = self.maskable_positions(input_ids, loss_mask)
        key = key or self.default_corruption_key(input_ids)
        corruption = diffusion.corrupt(input_ids, self.dlm_config, key, maskable, document_ids)
        weights, normalizer = diffusion.loss_weights(corruption, self.dlm_config, maskable)
        per_token, loss = self._forward(corruption.noisy_input_ids, position_ids, input_ids, weights, normalizer,
                                        document_ids, None, causal=False, checked=True)
        return LossOutput(loss, loss * normalizer, normalizer, per_token, corruption)
