"""Megatron's parallel_state getters, the documented compatibility shim, on a real layout."""

import pytest

pytestmark = pytest.mark.distributed


def _getters_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    state = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ranks = lambda group: dist.get_process_group_ranks(group)  # noqa: E731
    seen = {"tp": (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                   ranks(ps.get_tensor_model_parallel_group())),
            "dp": (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ranks(ps.get_data_parallel_group())),
            "pp": (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                   ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
            "state": (state.tp, state.tp_rank, state.dp, state.dp_rank)}
    import torch

    torch.save(seen, f"{out}.{rank}")


def test_megatron_named_getters_read_the_initialised_layout(tmp_path):
    """The compatibility shim (Megatron's `parallel_state.get_*` names) agrees with the state
    the wiring passes explicitly: tp fastest, so ranks {0,1} and {2,3} are tp peers."""
    import torch

    from tests.distributed.parity import free_port, start_workers

    out = str(tmp_path / "getters")
    start_workers(_getters_worker, (free_port(), out), 4)
    for rank in range(4):
        seen = torch.load(f"{out}.{rank}")
        assert seen["tp"] == (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1])
        assert seen["dp"] == (2, rank // 2, [rank % 2, rank % 2 + 2])
        assert seen["pp"] == (1, 0, True, True)
        assert seen["state"] == (2, rank % 2, 2, rank // 2)
