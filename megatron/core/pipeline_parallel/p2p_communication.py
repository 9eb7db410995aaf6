"""Point-to-point links between neighbouring pipeline stages.

A stage sends its output forward to the next stage and the gradient of its input backward to
the previous one. Virtual stages (interleaving) make the pipeline a ring: the last rank's
chunk j feeds the first rank's chunk j + 1.

Why the sends cannot deadlock, on gloo and on NCCL alike:
- every message goes out with an asynchronous `isend` the moment it exists, and a stage
  waits only for what it receives, right before the forward or backward that needs it;
- each kind of traffic has its own process group (`ParallelState.pipeline_p2p_groups`):
  forward, backward, and, for the ring's wrap-around link, forward-wrap and backward-wrap.
  Every pair of ranks in a group then talks in one direction only, so an NCCL send queued
  on a pair's stream never waits behind a receive that the peer posts later;
- a link delivers in the order it was written, and the schedules send and consume every
  link's micro-batches in the same order (tests/unit_tests/test_pipeline_schedules.py
  replays every schedule to check it).

Shapes: the forward tensors carry a small header (dtype and shape) before the data, on the
first message of a link only when the run's shapes are fixed, on every message with
`variable_shapes` (variable-length DLM batches; it costs a host sync per receive on GPU). A
backward gradient has the shape and dtype of the output it belongs to, which the receiver
holds.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

LINKS = ("forward", "backward", "forward_wrap", "backward_wrap")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype code, ndim, up to six dims


class PipelineLinks:
    """This rank's links to its pipeline neighbours (`ranks` are the pp group's global ranks)."""

    def __init__(self, ranks: Sequence[int], rank: int, groups: Dict[str, Optional[dist.ProcessGroup]],
                 device: torch.device, variable_shapes: bool = False) -> None:
        self.ranks, self.size = list(ranks), len(ranks)
        self.stage = self.ranks.index(rank)
        self.groups, self.device, self.variable_shapes = groups, device, variable_shapes
        self._known: Dict[Tuple[str, str], Tuple[Tuple[int, ...], torch.dtype]] = {}
        """Per (direction, link), the (shape, dtype) a header announced, when shapes are fixed
        (a middle stage receives and sends on links of the same name)."""
        self._pending: List[Tuple[dist.Work, torch.Tensor]] = []
        some_group = next(iter(groups.values()), None)
        self._through_host = device.type != "cpu" and dist.get_backend(some_group) == "gloo"
        """gloo sends host tensors only: device tensors travel through a host copy."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def _next(self) -> int:
        return self.ranks[(self.stage + 1) % self.size]

    def _previous(self) -> int:
        return self.ranks[(self.stage - 1) % self.size]

    # ------------------------------------------------------------------ forward
    def send_forward(self, tensor: torch.Tensor) -> None:
        """This stage's output to the next virtual stage (through the wrap link from the last rank)."""
        link = "forward_wrap" if self.is_last else "forward"
        tensor = tensor.detach().contiguous()
        signature, known = (tuple(tensor.shape), tensor.dtype), ("send", link)
        if self.variable_shapes or known not in self._known:
            self._send(self._header(*signature), self._next(), link)
            self._known[known] = signature
        elif self._known[known] != signature:
            raise RuntimeError(f"pipeline stage output changed from {self._known[known]} to {signature} in a run "
                               "with fixed shapes; variable-length batches need variable_shapes=True")
        self._send(tensor, self._next(), link)

    def recv_forward(self) -> torch.Tensor:
        """The previous virtual stage's output, as a leaf that collects this stage's input gradient."""
        link = "forward_wrap" if self.is_first else "forward"
        known = ("recv", link)
        if self.variable_shapes or known not in self._known:
            header = self._receive(torch.empty(_HEADER, dtype=torch.int64, device=self.device), link).tolist()
            ndim = header[1]
            self._known[known] = (tuple(header[2:2 + ndim]), _DTYPES[header[0]])
        shape, dtype = self._known[known]
        tensor = self._receive(torch.empty(shape, dtype=dtype, device=self.device), link)
        return tensor.requires_grad_()

    # ------------------------------------------------------------------ backward
    def send_backward(self, grad: torch.Tensor) -> None:
        """The gradient of this stage's input to the previous virtual stage."""
        self._send(grad.contiguous(), self._previous(), "backward_wrap" if self.is_first else "backward")

    def recv_backward(self, output: torch.Tensor) -> torch.Tensor:
        """The gradient of `output` (this stage's output) from the next virtual stage."""
        link = "backward_wrap" if self.is_last else "backward"
        return self._receive(torch.empty_like(output, memory_format=torch.contiguous_format), link)

    # ------------------------------------------------------------------ transport
    def _header(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if len(shape) > _HEADER - 2 or dtype not in _DTYPES:
            raise ValueError(f"cannot send a {dtype} tensor of shape {shape} between pipeline stages")
        values = [_DTYPES.index(dtype), len(shape), *shape] + [0] * (_HEADER - 2 - len(shape))
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _send(self, tensor: torch.Tensor, peer: int, link: str) -> None:
        if self._through_host:
            tensor = tensor.cpu()
        work = dist.isend(tensor, dst=peer, group=self.groups[link])
        self._pending.append((work, tensor))  # the tensor must live until the send completes
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def _receive(self, buffer: torch.Tensor, link: str) -> torch.Tensor:
        peer = self._previous() if link.startswith("forward") else self._next()
        if self._through_host:
            host = torch.empty(buffer.shape, dtype=buffer.dtype)
            dist.irecv(host, src=peer, group=self.groups[link]).wait()
            return buffer.copy_(host)
        dist.irecv(buffer, src=peer, group=self.groups[link]).wait()
        return buffer

    def wait_all(self) -> None:
        """Complete this rank's outstanding sends (the end of a schedule)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
