"""The pipeline schedules, replayed without processes: every rank's order of forwards and
backwards must complete (no rank waits forever), every link must deliver in the order its
receiver consumes, and 1F1B must bound the activations a stage holds."""

from collections import defaultdict, deque

import pytest

from megatron.core.pipeline_parallel.schedules import interleaved_order, one_f_one_b_order


def replay(orders, pipeline_size, num_chunks):
    """Run the ranks' orders the way PipelineLinks executes them: sends never block, a receive
    blocks until its message arrived. Returns the peak number of micro-batches in flight per rank
    (forward done, backward not yet) and asserts every received message is the one expected."""
    stages = pipeline_size * num_chunks
    inbox = defaultdict(deque)  # (kind, receiving rank) -> messages in arrival order
    position, in_flight, peak = [0] * pipeline_size, [0] * pipeline_size, [0] * pipeline_size
    while any(position[r] < len(orders[r]) for r in range(pipeline_size)):
        progressed = False
        for rank in range(pipeline_size):
            if position[rank] == len(orders[rank]):
                continue
            kind, chunk, microbatch = orders[rank][position[rank]]
            stage = chunk * pipeline_size + rank  # the virtual stage
            if kind == "F":
                if stage > 0:
                    if not inbox["F", rank]:
                        continue
                    assert inbox["F", rank].popleft() == (stage - 1, microbatch), (rank, kind, chunk, microbatch)
                if stage < stages - 1:
                    inbox["F", (rank + 1) % pipeline_size].append((stage, microbatch))
                in_flight[rank] += 1
            else:
                if stage < stages - 1:
                    if not inbox["B", rank]:
                        continue
                    assert inbox["B", rank].popleft() == (stage + 1, microbatch), (rank, kind, chunk, microbatch)
                if stage > 0:
                    inbox["B", (rank - 1) % pipeline_size].append((stage, microbatch))
                in_flight[rank] -= 1
            peak[rank] = max(peak[rank], in_flight[rank])
            position[rank] += 1
            progressed = True
        assert progressed, f"deadlock: positions {position} of {[len(o) for o in orders]}"
    assert not any(inbox.values())
    return peak


def _every_pass_once(order, num_chunks, num_microbatches, forward_only):
    kinds = ("F",) if forward_only else ("F", "B")
    expected = sorted((k, c, m) for k in kinds for c in range(num_chunks) for m in range(num_microbatches))
    assert sorted(order) == expected


@pytest.mark.parametrize("pipeline_size", [2, 3, 4])
@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("forward_only", [False, True])
def test_one_f_one_b_completes_and_holds_at_most_p_minus_stage_micro_batches(pipeline_size, num_microbatches,
                                                                              forward_only):
    orders = [one_f_one_b_order(pipeline_size, rank, num_microbatches, forward_only) for rank in range(pipeline_size)]
    for order in orders:
        _every_pass_once(order, 1, num_microbatches, forward_only)
    peak = replay(orders, pipeline_size, 1)
    if not forward_only:
        for rank in range(pipeline_size):
            assert peak[rank] == min(pipeline_size - rank, num_microbatches)


@pytest.mark.parametrize("pipeline_size,num_chunks", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("forward_only", [False, True])
def test_interleaved_completes_and_delivers_in_order(pipeline_size, num_chunks, groups, forward_only):
    num_microbatches = groups * pipeline_size
    orders = [interleaved_order(pipeline_size, rank, num_chunks, num_microbatches, forward_only)
              for rank in range(pipeline_size)]
    for order in orders:
        _every_pass_once(order, num_chunks, num_microbatches, forward_only)
    peak = replay(orders, pipeline_size, num_chunks)
    if not forward_only and groups >= 2:
        # Megatron's count for the first rank: 2(p - 1) + (v - 1) p warm-up forwards, plus one.
        assert peak[0] == min(2 * (pipeline_size - 1) + (num_chunks - 1) * pipeline_size + 1,
                              num_chunks * num_microbatches)


def test_interleaved_needs_whole_groups_of_micro_batches():
    with pytest.raises(ValueError, match="divisible by the pipeline size 2"):
        interleaved_order(2, 0, 2, 3)
