"""Two ranks: only rank 0 builds the GPTDataset index files; both read identical samples."""

import hashlib
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.datasets.dataset_builder import DatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from tests.distributed.parity import free_port, start_workers
from tests.unit_tests.test_gpt_dataset import write_unique_token_corpus

pytestmark = pytest.mark.distributed


def _worker(rank: int, port: int, prefix: str, cache: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    builder = DatasetBuilder(GPTDatasetConfig(8, 3, cache), barrier=dist.barrier, is_builder=rank == 0)
    train, valid, _ = builder.from_split([prefix], "9,1,0", [50, 5, 0])
    digest = hashlib.sha256()
    for dataset in (train, valid):
        for index in range(len(dataset)):
            digest.update(dataset[index]["tokens"].numpy().tobytes())
    torch.save({"built": [train.built_now, valid.built_now], "digest": digest.hexdigest()}, f"{out}.{rank}")
    dist.barrier()


def test_only_rank_zero_builds_and_both_ranks_read_the_same(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_unique_token_corpus(prefix)
    out = str(tmp_path / "result")
    start_workers(_worker, (free_port(), prefix, str(tmp_path / "cache"), out), 2)
    rank0, rank1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert rank0["built"] == [True, True] and rank1["built"] == [False, False]
    assert rank0["digest"] == rank1["digest"]

