"""Batch samplers that split each global batch over data-parallel ranks and resume exactly.

Global batch k covers samples [k * gbs, (k + 1) * gbs) of the stream. Micro-batch m of
data-parallel rank r holds samples  start + m * mbs * dp + r * mbs + [0, mbs), as in
Megatron, so the set of samples of a step does not depend on the layout and the
corruption (keyed by sample index) matches between DP=2 and one process with
accumulation.
"""

from __future__ import annotations

from typing import Iterator, List


class MegatronPretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: total_samples={total_samples}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} outside [0, {data_parallel_size})")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        per_step = self.micro_batch_size * self.size
        mine = slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)
        for first in range(self.consumed_samples, self.total_samples, per_step):
            batch = list(range(first, min(first + per_step, self.total_samples)))
            if len(batch) == per_step or not self.drop_last:
                yield batch[mine]
