"""CUDA graphs for generation: each forward shape is captured once, then replayed.

At batch 1 a decoder forward launches hundreds of small kernels and the GPU waits on the
host between them; replaying a captured graph launches them all at once. `CUDAGraphRunner`
wraps a generation `model_fn` (megatron.core.inference.generation's contract) and keeps the
same contract, so the samplers do not know it is there:

    runner = CUDAGraphRunner(model.inference_forward)       # or model.generate(..., cuda_graphs=True)
    generation.generate(runner, input_ids, running_mode=..., cache="dual", ...)

A call whose key (the input shapes and the cache length) is new runs eagerly (checks, lazy
allocations, torch.compile and autotuning happen here), then its graph is captured; every
later call with that key copies its inputs into the graph's buffers and replays it. The cache
offset is one of those inputs (the tensor of slots the cache writes, refilled before each
replay after a host-side range check), so one graph serves every offset. Graphs per diffusion
generation: one without a cache; two with the dual cache (the full-canvas refresh and the
block); with the prefix cache one per block, whose lengths differ. AR decoding with a cache:
the prompt pass and the one-token step. Calls whose shapes keep changing (AR decoding without
a cache) would capture a graph per call: after `max_graphs` keys new ones just run eagerly.

A graph writes into fixed addresses, so the runner owns the KV caches: one per (batch,
length), reused by every generation of that size. The caller's `KVCache` only says that a
cache is wanted and how long it is; it stays empty. Reuse is safe because every generation
overwrites the slots before it reads them (a full-canvas pass at each block start, the
prompt pass in AR decoding) and the masks hide the slots not yet written. Outputs are copies,
so they survive the next call. Ids are checked on the device inside a graph (a bad id aborts
the process with the usual message), since a graph cannot stop for a host-side check.

Like generation.py this file imports only torch and its neighbour, so the Hugging Face
exporter ships it too (`DLMForCausalLM.generate(..., cuda_graphs=True)`).
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch
from torch import nn

from .kv_cache import KVCache

ModelFn = Callable[..., torch.Tensor]


class _Graph:
    """One captured forward and the static tensors it reads and writes."""

    def __init__(self, inputs: List[torch.Tensor], slots: Optional[torch.Tensor], output: torch.Tensor,
                 graph: torch.cuda.CUDAGraph) -> None:
        self.inputs, self.slots, self.output, self.graph = inputs, slots, output, graph
        self.offsets = None if slots is None else torch.arange(len(slots), device=slots.device)

    def replay(self, inputs: Tuple[torch.Tensor, ...], cache_start: int) -> torch.Tensor:
        for static, new in zip(self.inputs, inputs):
            static.copy_(new)
        if self.slots is not None:
            torch.add(self.offsets, cache_start, out=self.slots)
        self.graph.replay()
        return self.output.clone()


class CUDAGraphRunner:
    """A generation `model_fn` that replays one CUDA graph per input shape (see the module doc)."""

    def __init__(self, model_fn: ModelFn, max_graphs: int = 64, module: Optional[nn.Module] = None) -> None:
        """`module`: the model whose weights `model_fn` reads; `reads_weights_of` then tells
        whether they are still the tensors the graphs were captured with."""
        if not torch.cuda.is_available():
            raise ValueError("CUDA graphs need a CUDA device; generate without cuda_graphs (--cuda-graphs) here")
        if max_graphs < 1:
            raise ValueError(f"CUDAGraphRunner max_graphs={max_graphs} must be at least 1")
        self.model_fn, self.max_graphs = model_fn, max_graphs
        self.graphs: Dict[Hashable, _Graph] = {}
        self.caches: Dict[Tuple[int, int], KVCache] = {}
        self.replays = 0
        """Calls answered by a replay (the rest ran eagerly)."""
        self._pool = torch.cuda.graph_pool_handle()  # graphs run one after another: they can share memory
        self._stream: Optional[torch.cuda.Stream] = None
        self._weights = None if module is None else _storage(module)

    def reads_weights_of(self, module: nn.Module) -> bool:
        return self._weights == _storage(module)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 kv_cache: Optional[KVCache] = None, cache_start: int = 0) -> torch.Tensor:
        if input_ids.device.type != "cuda":
            raise ValueError(f"CUDAGraphRunner got input_ids on {input_ids.device}; move the model and the prompt "
                             "to a CUDA device, or generate without cuda_graphs")
        inputs = (input_ids, position_ids, attention_mask)
        cache = None if kv_cache is None else self._cache(input_ids.shape[0], kv_cache.max_length)
        key = (tuple((tuple(t.shape), t.dtype, t.device) for t in inputs), None if cache is None else cache.max_length)
        if cache is not None and not 0 <= cache_start <= cache.max_length - input_ids.shape[1]:
            raise ValueError(f"cache_start {cache_start} + {input_ids.shape[1]} positions fall outside the "
                             f"KV cache's [0, {cache.max_length})")
        graph = self.graphs.get(key)
        if graph is not None:
            self.replays += 1
            return graph.replay(inputs, cache_start)
        # The eager call writes by slots too, so compiled layers see one kind of offset (ints
        # would add compiled graphs: dynamo specialises the values 0 and 1).
        output = self.model_fn(*inputs, cache, cache_start if cache is None else _slots(cache_start, input_ids))
        if len(self.graphs) < self.max_graphs:
            self.graphs[key] = self._capture(inputs, cache, cache_start)
        return output

    def _cache(self, batch: int, max_length: int) -> KVCache:
        if (batch, max_length) not in self.caches:
            self.caches[(batch, max_length)] = KVCache(None, max_length)
        return self.caches[(batch, max_length)]

    def _capture(self, inputs: Tuple[torch.Tensor, ...], cache: Optional[KVCache], cache_start: int) -> _Graph:
        static = [tensor.clone() for tensor in inputs]
        slots = None if cache is None else _slots(cache_start, inputs[0])
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=inputs[0].device)
        # Warm up on the capture stream first: libraries set up per-stream state (cuBLAS
        # workspaces) lazily, which a capture must not do. It rewrites the cache slots with
        # the values the eager call just wrote.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self.model_fn(*static, cache, cache_start if slots is None else slots)
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            output = self.model_fn(*static, cache, cache_start if slots is None else slots)
        return _Graph(static, slots, output, graph)


def _slots(cache_start: int, input_ids: torch.Tensor) -> torch.Tensor:
    """The cache slots [q] that a forward of `input_ids` [B, q] writes, on its device."""
    return torch.arange(cache_start, cache_start + input_ids.shape[1], device=input_ids.device)


def _storage(module: nn.Module) -> Tuple[int, ...]:
    return tuple(tensor.data_ptr() for tensor in (*module.parameters(), *module.buffers()))


def runner_for(module: nn.Module, model_fn: ModelFn, runner: Optional[CUDAGraphRunner]) -> CUDAGraphRunner:
    """`runner` while its graphs still read `module`'s weight tensors (in-place changes, such
    as an optimizer step or a load into the model, are seen); a new runner over `model_fn`
    once they were replaced (`.to(dtype)`, another device), since the old graphs would read
    freed memory."""
    if runner is not None and runner.reads_weights_of(module):
        return runner
    return CUDAGraphRunner(model_fn, module=module)
