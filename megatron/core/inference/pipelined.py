"""Forwards outside the training schedules on a pipeline-parallel model: sampling (generation.py) with every
stage together, and RL's reference-policy forward.

The sampler calls its model once a step and decides from the logits which tokens to commit. Here each
call runs this rank's stages in pipeline order, the activations handed along the links (the ring of
virtual stages under interleaving), so only the last stage holds logits. Sending them back would move
B x q x V values a step; instead the last stage decides and `share` broadcasts its decisions, the
canvas and the rows' finished flags (B x L integers), over the pipeline group. The sampler's control
flow reads only those, so every stage runs the same forwards with the same shapes. Each stage keeps
the KV cache of its own layers (one `KVCache`, keyed by global layer number).

Only the last stage draws (per-row seeds or a generator), so the completions are those of the one-stage
model with the same weights.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.data_parallel import unwrap
from megatron.core.inference import generation
from megatron.core.pipeline_parallel.chunks import model_chunks
from megatron.core.pipeline_parallel.p2p_communication import PipelineLinks

__all__ = ["PipelineStages", "sampling_chunks"]


def sampling_chunks(model: nn.Module) -> List[nn.Module]:
    """The GPTModel chunks of a rank's (wrapped) model, in pipeline order."""
    return [unwrap(chunk) for chunk in model_chunks(unwrap(model))]


class PipelineStages:
    """This rank's stage(s) of a pipeline run together with the other ranks of the pipeline group: `generate`
    as GPTModel's (called on every rank with the same prompts and options, each returns the same
    completions) and `forward`, any forward through the stages in order."""

    def __init__(self, model: nn.Module, links: PipelineLinks, group: Optional[dist.ProcessGroup]) -> None:
        self.chunks = sampling_chunks(model)
        # Its own links: their shapes change from call to call (the training's may be fixed).
        self.links = PipelineLinks(links.ranks, links.ranks[links.stage], links.groups, links.device,
                                   variable_shapes=True)
        self.group, self.source = group, links.ranks[-1]
        self._through_host = links.device.type != "cpu" and dist.get_backend(group) == "gloo"

    @property
    def decides(self) -> bool:
        """The last stage decides (it holds the logits)."""
        return self.links.is_last

    @property
    def running_mode(self) -> str:
        return self.chunks[0].running_mode

    @property
    def dlm_config(self):
        return self.chunks[0].dlm_config

    def parameters(self):
        return self.chunks[0].parameters()

    def forward(self, run: Callable[[int, Optional[torch.Tensor]], object], chunks: Optional[List[nn.Module]] = None):
        """`run(index, received)` for each of this rank's stages in pipeline order (`received`: the previous
        stage's output, None on the first stage), each output sent on to the next stage; the last stage's
        output on the last rank, None on the others. `chunks`: another model of the same layout (RL's
        reference policy), whose chunks then take the received activations as their input tensor."""
        last = len(self.chunks) - 1
        output = None
        for index in range(last + 1):
            received = None if self.links.is_first and index == 0 else self.links.recv_forward().detach()
            if chunks is not None:
                chunks[index].set_input_tensor(received)
            output = run(index, received)
            if not (self.links.is_last and index == last):
                self.links.send_forward(output)
        self.links.wait_all()
        for chunk in chunks or ():
            chunk.set_input_tensor(None)
        return output if self.decides else None

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 kv_cache=None, cache_start=0) -> Optional[torch.Tensor]:
        """The sampler's model_fn: the logits on the last stage, else None."""
        return self.forward(lambda index, received: self.chunks[index].inference_forward(
            input_ids, position_ids, attention_mask, kv_cache, cache_start, decoder_input=received))

    def share(self, *tensors: torch.Tensor) -> None:
        """Overwrite each tensor, in place, with the last stage's values."""
        for tensor in tensors:
            buffer = tensor.to(torch.float64 if tensor.is_floating_point() else torch.int64).contiguous()
            if self._through_host:
                buffer = buffer.cpu()
            dist.broadcast(buffer, src=self.source, group=self.group)
            tensor.copy_(buffer)

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 **options) -> torch.Tensor:
        """GPTModel.generate's sampling (the trained attention pattern, sequence parallelism off) over the
        pipeline; not CUDA graphs or autoregressive decoding of a DLM."""
        first = self.chunks[0]
        with contextlib.ExitStack() as stack:
            for chunk in self.chunks:
                stack.enter_context(chunk.sequence_parallel_off())
            return generation.generate(self, input_ids, attention_mask, running_mode=first.running_mode,
                                       mask_token_id=first.dlm_config.mask_token_id, stages=self,
                                       **(first.trained_pattern() | options))
