"""How the micro-batches of one global batch run: the seam pipeline schedules plug into.

The contract every schedule keeps (Megatron's `forward_backward_func`):
- `forward_step(data_iterator, model, microbatch) -> (output, loss_func)` runs one micro-batch's
  forward; `loss_func(output) -> (loss_sum, normalizer)`: the sum of its weighted token losses
  and what that sum will be divided by (see distributed/loss_normalization.py), or
  `(loss_sum, normalizer, part_sums)` for a loss of several terms, each term's sum to log;
- the loss exists on the last stage only (with one stage, everywhere); each micro-batch's
  `loss_sum` is backpropagated as it is (through `scale_loss`, fp16's loss scaling), never
  divided: the division happens once per global batch;
- gradients are synchronised over data-parallel replicas on the last micro-batch only;
- every micro-batch's values are added to the `GlobalBatchLoss` it is given, which the caller
  reduces once.
`forward_backward_no_pipelining` is the schedule of one pipeline stage;
`forward_backward_pipelining` runs 1F1B (`one_f_one_b_order`) and interleaved 1F1B
(`interleaved_order`) over the links of p2p_communication.py. Every stage runs `forward_step`
for every micro-batch and so reads the data itself: the corruption is a pure function of the
sample key (objective.py), so the first stage derives the noisy ids, the last the labels,
weights and normalizer, and every stage the attention mask, with nothing sent but hidden
states and their gradients.

Why our own schedules over batched isend/irecv rather than `torch.distributed.pipelining`:
across torch 2.11-2.13 its stage and step signatures change, it fixes shapes after the first
step (variable-length DLM batches then fail), it divides accumulated gradients by the number of
micro-batches by default (our loss is a sum over a global normalizer), it calls the loss an
extra time on the first step and wants one Tensor as the target. Megatron's own
approach (p2p between neighbours, a schedule per rank) keeps every contract above as it is.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from megatron.core.distributed.data_parallel import is_fully_sharded, no_sync, unwrap
from megatron.core.distributed.loss_normalization import GlobalBatchLoss
from megatron.core.pipeline_parallel.chunks import model_chunks
from megatron.core.pipeline_parallel.compute_clock import ComputeClock
from megatron.core.pipeline_parallel.p2p_communication import PipelineLinks
from megatron.core.tensor_parallel.fp32_weight_grad import accumulating_into_grad

LossFunc = Callable[[torch.Tensor], Tuple[torch.Tensor, ...]]
ForwardStep = Callable[[Iterator, nn.Module, int], Tuple[torch.Tensor, LossFunc]]
Action = Tuple[str, int, int]
"""("F" or "B", model chunk, micro-batch): one forward or backward of a rank's schedule."""


def forward_backward_no_pipelining(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                   num_microbatches: int, loss: GlobalBatchLoss, forward_only: bool = False,
                                   scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                                   clock: Optional[ComputeClock] = None) -> GlobalBatchLoss:
    """Forward (and, unless `forward_only`, backward) every micro-batch in turn on one stage.
    `clock` is taken for the schedules' common signature and left alone: one stage has no bubble."""
    for microbatch in range(num_microbatches):
        last = microbatch == num_microbatches - 1
        with no_sync(model, last_microbatch=last or forward_only):
            output, loss_func = forward_step(data_iterator, model, microbatch)
            loss_sum, normalizer, *parts = loss_func(output)
            if not forward_only:
                (scale_loss(loss_sum) if scale_loss is not None else loss_sum).backward()
        loss.add(loss_sum, normalizer, *parts)
    return loss


def one_f_one_b_order(pipeline_size: int, stage: int, num_microbatches: int,
                      forward_only: bool = False) -> List[Action]:
    """1F1B on stage `stage`: p - stage - 1 warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards. A stage holds at most p - stage micro-batches'
    activations at once (Megatron's and PipeDream-Flush's schedule)."""
    if forward_only:
        return [("F", 0, mb) for mb in range(num_microbatches)]
    warmup = min(pipeline_size - stage - 1, num_microbatches)
    order = [("F", 0, mb) for mb in range(warmup)]
    for index in range(num_microbatches - warmup):
        order += [("F", 0, warmup + index), ("B", 0, index)]
    return order + [("B", 0, mb) for mb in range(num_microbatches - warmup, num_microbatches)]


def _virtual_microbatch(index: int, pipeline_size: int, num_chunks: int, forward: bool) -> Tuple[int, int]:
    """(chunk, micro-batch) of the index-th forward (or backward) of an interleaved rank: groups of
    p micro-batches go through chunk 0, then chunk 1, ... (backwards through the chunks in reverse)."""
    group, within = divmod(index, pipeline_size * num_chunks)
    chunk = within // pipeline_size
    return (chunk if forward else num_chunks - 1 - chunk), group * pipeline_size + within % pipeline_size


def interleaved_order(pipeline_size: int, stage: int, num_chunks: int, num_microbatches: int,
                      forward_only: bool = False) -> List[Action]:
    """Interleaved 1F1B (Megatron's virtual pipeline) on rank `stage` holding `num_chunks` chunks:
    2 (p - stage - 1) + (v - 1) p warm-up forwards, then 1F1B over the virtual micro-batches.
    Needs the micro-batches in whole groups of p."""
    if num_microbatches % pipeline_size:
        raise ValueError(f"the interleaved schedule needs the {num_microbatches} micro-batches per step divisible "
                         f"by the pipeline size {pipeline_size}")
    total = num_microbatches * num_chunks
    forwards = [("F", *_virtual_microbatch(k, pipeline_size, num_chunks, True)) for k in range(total)]
    if forward_only:
        return forwards
    backwards = [("B", *_virtual_microbatch(k, pipeline_size, num_chunks, False)) for k in range(total)]
    warmup = min(total, 2 * (pipeline_size - stage - 1) + (num_chunks - 1) * pipeline_size)
    order = forwards[:warmup]
    for index in range(total - warmup):
        order += [forwards[warmup + index], backwards[index]]
    return order + backwards[total - warmup:]


class SharedMicrobatches:
    """One data iterator read by several chunks: every chunk gets every micro-batch, in order,
    and the samples are read once (the first chunk to ask reads; the last to use drops)."""

    def __init__(self, iterator: Iterator, num_chunks: int) -> None:
        self.iterator, self.num_chunks = iterator, num_chunks
        self.cache: Dict[int, List] = {}  # micro-batch -> [sample, readers left]
        self.read = 0

    def _get(self, microbatch: int):
        while self.read <= microbatch:
            self.cache[self.read] = [next(self.iterator), self.num_chunks]
            self.read += 1
        entry = self.cache[microbatch]
        entry[1] -= 1
        if entry[1] == 0:
            del self.cache[microbatch]
        return entry[0]

    def for_chunk(self) -> Iterator:
        return (self._get(microbatch) for microbatch in itertools.count())


def _backward(output: torch.Tensor, output_grad: Optional[torch.Tensor], chunk: nn.Module, sync: bool) -> None:
    """One backward of a stage; FSDP2 reduce-scatters the gradients on a chunk's last micro-batch only."""
    if is_fully_sharded(chunk):
        chunk.set_requires_gradient_sync(sync)
    torch.autograd.backward(output, grad_tensors=output_grad)


def forward_backward_pipelining(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                num_microbatches: int, loss: GlobalBatchLoss, forward_only: bool = False,
                                scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, *,
                                links: PipelineLinks, order: List[Action],
                                clock: Optional[ComputeClock] = None) -> GlobalBatchLoss:
    """Run this rank's `order` of forwards and backwards, receiving each input and output gradient
    just before it is needed and sending each result as soon as it exists. The loss (on the last
    virtual stage) goes into `loss`. Gradients are left unsynchronised over data-parallel
    replicas except by FSDP2 on each chunk's last micro-batch (finalize_gradients does the rest).
    `clock` (the level-2 timers) times each forward and backward between its receive and its send."""
    chunks = model_chunks(model)
    last_chunk = len(chunks) - 1
    shared = SharedMicrobatches(data_iterator, len(chunks)) if len(chunks) > 1 else None
    iterators = [shared.for_chunk() for _ in chunks] if shared else [data_iterator]
    saved: Dict[Tuple[int, int], Tuple[Optional[torch.Tensor], torch.Tensor]] = {}

    def computing(name: str):
        return clock.span(name) if clock is not None else contextlib.nullcontext()
    for kind, chunk, microbatch in order:
        first, last = links.is_first and chunk == 0, links.is_last and chunk == last_chunk
        if kind == "F":
            received = None if first else links.recv_forward()
            unwrap(chunks[chunk]).set_input_tensor(received)
            # weight gradients added into .grad in place where one exists (fp32_weight_grad); no wrapper
            # hook reads them under pipelining but FSDP2's
            in_place = accumulating_into_grad(chunks[chunk], not is_fully_sharded(chunks[chunk]))
            with computing("forward-compute"), in_place:
                output, loss_func = forward_step(iterators[chunk], chunks[chunk], microbatch)
                if last:
                    loss_sum, normalizer, *parts = loss_func(output)
                    loss.add(loss_sum, normalizer, *parts)
                    output = scale_loss(loss_sum) if scale_loss is not None else loss_sum
            if not last:
                links.send_forward(output)
            if not forward_only:
                saved[chunk, microbatch] = (received, output)
            continue
        received, output = saved.pop((chunk, microbatch))
        output_grad = None if last else links.recv_backward(output)
        with computing("backward-compute"):
            _backward(output, output_grad, chunks[chunk], sync=microbatch == num_microbatches - 1)
        if not first:
            links.send_backward(received.grad)
    links.wait_all()
    for chunk in chunks:
        unwrap(chunk).set_input_tensor(None)
    return loss


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              links: Optional[PipelineLinks] = None) -> Callable:
    """The schedule for this layout (Megatron's name for the choice): no pipelining, 1F1B, or
    interleaved 1F1B with `virtual_pipeline_model_parallel_size` chunks per rank. Each takes `clock=`
    (a ComputeClock, or None), with which a pipelined schedule times its compute."""
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    if links is None or links.size != pipeline_model_parallel_size:
        raise ValueError(f"a pipeline of {pipeline_model_parallel_size} stages needs this rank's PipelineLinks")
    chunks = virtual_pipeline_model_parallel_size or 1

    def schedule(forward_step, data_iterator, model, num_microbatches, loss, forward_only=False, scale_loss=None,
                 clock=None):
        if chunks == 1:
            order = one_f_one_b_order(links.size, links.stage, num_microbatches, forward_only)
        else:
            order = interleaved_order(links.size, links.stage, chunks, num_microbatches, forward_only)
        return forward_backward_pipelining(forward_step, data_iterator, model, num_microbatches, loss,
                                           forward_only, scale_loss, links=links, order=order, clock=clock)

    return schedule
