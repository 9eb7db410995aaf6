"""Rank grouping of the parallel layout (Megatron order: tp fastest, then cp, dp, pp)."""

import pytest

from megatron.core.parallel_state import ParallelState, check_layout, rank_groups


def test_groups_follow_megatron_rank_order():
    grid = {"tp": 2, "cp": 1, "dp": 2, "pp": 2}
    assert rank_groups(grid, ["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups(grid, ["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(grid, ["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    grid = {"tp": 2, "cp": 2, "dp": 2, "pp": 1}
    assert rank_groups(grid, ["cp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(grid, ["cp", "dp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    grid = {"tp": 2, "cp": 2, "dp": 3, "pp": 2}
    for dims in (["tp"], ["cp"], ["dp"], ["pp"], ["cp", "dp"]):
        groups = rank_groups(grid, dims)
        assert sorted(r for g in groups for r in g) == list(range(24))


def test_single_process_state_without_a_process_group():
    state = ParallelState()
    assert (state.tp, state.dp, state.pp, state.tp_rank) == (1, 1, 1, 0)
    assert "rank order" in state.layout_table()


@pytest.mark.parametrize("world,sizes,flag", [(6, dict(tp=4), "--tensor-model-parallel-size"),
                                              (8, dict(tp=2, pp=3), "world size 8"),
                                              (4, dict(tp=1, ep=3), "--expert-model-parallel-size")])
def test_layouts_the_world_cannot_hold_fail_clearly(world, sizes, flag):
    args = dict(tp=1, pp=1, cp=1, ep=1) | sizes
    with pytest.raises(ValueError, match=flag):
        check_layout(world, **args)
