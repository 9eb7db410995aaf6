"""Batch metadata and id checks: what the data side derives from a batch before the model runs.

Packed rows carry several documents; `document_ids_from_eod` numbers them and
`positions_from_documents` restarts the position ids in each, so `get_batch`
(pretrain_difflm.py) and the model's default positions agree. The id checks (`check_model_inputs`:
a forward's ids against the TransformerConfig's limits) fail with a message naming the tensor and
the flag to fix, in one host sync at most, instead of an index error deep inside an embedding
lookup. Nothing here depends on the model or the diffusion process.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

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


def check_model_inputs(config: TransformerConfig, input_ids: Optional[torch.Tensor],
                       position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                       has_embedding: bool = True) -> None:
    """Shapes and id ranges of a model forward's inputs, in one host sync at most (see
    TransformerConfig.check_token_ids), so bad data fails before the decoder runs. A pipeline
    stage without the embedding (`has_embedding=False`) reads no input ids: only their shape
    against the labels' is checked there."""
    if has_embedding and (input_ids is None or input_ids.dim() != 2):
        raise ValueError("input_ids must be a [batch, seq] tensor of token ids")
    if labels is not None and input_ids is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the batch {tuple(input_ids.shape)}")
    check_id_ranges([("input_ids", input_ids if has_embedding else None, config.vocab_size, VOCAB_FIX),
                     ("position_ids", position_ids, config.max_position_embeddings, POSITION_FIX),
                     ("labels", labels, config.vocab_size, VOCAB_FIX)], sync=config.check_token_ids)


def check_inference_inputs(config: TransformerConfig, input_ids: torch.Tensor, position_ids: torch.Tensor,
                           context_parallel: bool, sequence_parallel: bool, has_input: bool) -> None:
    """GPTModel.inference_forward's inputs and model: whole sequences (no context or sequence parallelism),
    the stage's input (`has_input`: the embedding, or the previous stage's output), ids [batch, q]."""
    if context_parallel:
        raise ValueError("inference_forward needs whole sequences on one rank; build the model for generation "
                         "with context_parallel_size=1")
    if sequence_parallel:
        raise ValueError("inference_forward does not support sequence parallelism; build the model for "
                         "generation with sequence_parallel=False (the weights are the same)")
    if not has_input:
        raise ValueError("a pipeline stage without the embedding needs decoder_input [q, b, h]: the previous "
                         "stage's output")
    if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                         "must both be [batch, q]")
    check_model_inputs(config, input_ids, position_ids)


def document_ids_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Packed-document ids: a document runs up to and including its EOD token."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 at every document boundary of a packed row."""
    seq = document_ids.shape[1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_of_document = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_of_document


def context_parallel_inputs(shard, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                            labels: Optional[torch.Tensor], loss_weights: Optional[torch.Tensor],
                            document_ids: Optional[torch.Tensor], shift: bool):
    """This context-parallel rank's share of whole-sequence inputs (transformer/context_parallel.py):
    (input_ids, position_ids, labels, loss_weights, query_positions, key_positions).

    Positions default to the whole sequence's (per document when `document_ids` are given)
    before slicing. `shift` (difflm-shift: target j predicted at j - 1) is folded into the labels
    here, on whole rows, so no rank needs its neighbour's hidden state: position i then carries
    the label and weight of i + 1, and the last position none. `document_ids` stay whole: the
    attention mask reads them at the true positions."""
    reference = next(t for t in (input_ids, labels, document_ids, position_ids) if t is not None)
    batch, length = reference.shape[0], reference.shape[1]
    device = reference.device
    if position_ids is None:
        position_ids = (positions_from_documents(document_ids) if document_ids is not None
                        else torch.arange(length, device=device).expand(batch, length))
    if shift and labels is not None:
        weights = (torch.ones(labels.shape, dtype=torch.float32, device=device) if loss_weights is None
                   else loss_weights)
        labels = torch.cat([labels[:, 1:], labels[:, :1]], dim=1)
        loss_weights = torch.cat([weights[:, 1:], torch.zeros_like(weights[:, :1])], dim=1)
    query_positions, key_positions = shard.positions(length, device)
    return (shard.slice(input_ids), shard.slice(position_ids), shard.slice(labels), shard.slice(loss_weights),
            query_positions, key_positions)
