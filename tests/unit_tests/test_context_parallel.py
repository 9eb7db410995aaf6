"""Context parallelism's pieces in one process: which positions a rank holds, the slicing of
whole-sequence inputs (difflm-shift folded into the labels), and the flag checks."""

import pytest
import torch

from custom_args.difflm import add_difflm_args
from megatron.core.models.difflm.batch import context_parallel_inputs
from megatron.core.transformer.context_parallel import ContextShard, gathered_positions, shard_positions
from megatron.training.arguments import parse_args
from tests.unit_tests.test_bad_inputs_training import TINY, error_line


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("balanced", [False, True])
def test_the_ranks_hold_every_position_exactly_once(cp_size, balanced):
    seq_len = 24
    held = [shard_positions(seq_len, cp_size, rank, balanced) for rank in range(cp_size)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq_len))
    assert torch.equal(gathered_positions(seq_len, cp_size, balanced), torch.cat(held))
    if balanced:  # rank i: chunks i and 2C-1-i, so early and late queries pair up
        chunk = seq_len // (2 * cp_size)
        for rank, positions in enumerate(held):
            assert positions[0] == rank * chunk and positions[chunk] == (2 * cp_size - 1 - rank) * chunk
            assert (positions.float().mean() - (seq_len - 1) / 2).abs() < 1e-6
    else:
        assert all(torch.equal(p, torch.arange(r * seq_len // cp_size, (r + 1) * seq_len // cp_size))
                   for r, p in enumerate(held))


def test_lengths_the_split_cannot_cut_are_refused():
    with pytest.raises(ValueError, match="not divisible by 2 x --context-parallel-size 2"):
        shard_positions(6, 2, 0, balanced=True)


class _Shard(ContextShard):
    def __init__(self, size, rank, mask_type):  # a cp group without processes
        self.group, self.size, self.rank, self.balanced = None, size, rank, mask_type != "no_mask"


def test_shift_is_folded_into_the_labels_before_slicing():
    """difflm-shift: target j is predicted at j - 1. After slicing, position i of each rank carries
    the label and weight of i + 1 (the last position none), so no rank needs its neighbour."""
    labels = torch.arange(8).view(1, 8) + 10
    weights = torch.linspace(1, 2, 8).view(1, 8)
    pieces = [context_parallel_inputs(_Shard(2, rank, "no_mask"), labels, None, labels, weights, None, shift=True)
              for rank in range(2)]
    got_labels = torch.cat([p[2] for p in pieces], dim=1)
    got_weights = torch.cat([p[3] for p in pieces], dim=1)
    assert torch.equal(got_labels[0, :7], labels[0, 1:])
    assert torch.equal(got_weights[0, :7], weights[0, 1:]) and got_weights[0, 7] == 0
    assert torch.equal(torch.cat([p[1] for p in pieces], dim=1), torch.arange(8).view(1, 8))  # default positions


def test_positions_default_per_document_before_slicing():
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    _, positions, *_ = context_parallel_inputs(_Shard(2, 1, "causal"), documents, None, None, None, documents,
                                               shift=False)
    # rank 1 of 2, balanced: chunks 1 and 2 of 4 -> global positions 2, 3, 4, 5
    assert positions.tolist() == [[2, 0, 1, 2]]


def _parse_error(argv, world_size, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, add_difflm_args, world_size=world_size)
    assert exit_info.value.code == 2
    return error_line(capsys.readouterr().err)


@pytest.mark.parametrize("extra,world_size,message", [
    (["--context-parallel-size", "2", "--seq-length", "18", "--model-running-mode", "vanilla"], 2,
     "--seq-length 18 is not divisible by 4 (2 x --context-parallel-size"),
    (["--context-parallel-size", "4", "--seq-length", "18"], 4, "--seq-length 18 is not divisible by 4"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length",
      "18", "--hidden-size", "16", "--num-attention-heads", "2"], 4,
     "--context-parallel-size x --tensor-model-parallel-size"),
    (["--context-parallel-size", "2", "--difflm-varilen-prob", "0.5", "--difflm-varilen-multiple", "3",
      "--seq-length", "18"], 2, "--difflm-varilen-multiple 3 is not divisible by 2"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p"], 2,
     "cp_comm_type='p2p' is not one of ['all_gather', 'a2a']; pick one of them (flag --cp-comm-type)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a"], 4,
     "--cp-comm-type a2a needs the 2 attention heads per tensor-parallel rank divisible by --context-parallel-size 4"),
    (["--cp-comm-type", "a2a"], 1, "--cp-comm-type has no effect without --context-parallel-size > 1"),
    (["--context-parallel-size", "3"], 2, "not divisible"),
])
def test_bad_context_parallel_flags_exit_2_with_one_line(extra, world_size, message, capsys):
    assert message in _parse_error(TINY + extra, world_size, capsys)


def test_context_parallel_layout_parses_and_records_the_group_sizes():
    args = parse_args(TINY + ["--context-parallel-size", "2"], add_difflm_args, world_size=4)
    assert args.context_parallel_size == 2 and args.data_parallel_size == 2
