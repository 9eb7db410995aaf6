"""The pipeline-parallel layer split (pipeline_parallel/layer_split.py) and its flags.

Every expected list is worked out by hand from Megatron-LM's rules, in the order of the virtual
stages s = chunk x pipeline size + rank; every error names the flag to change.
"""

import pytest

from custom_args.difflm import add_difflm_args
from megatron.core.pipeline_parallel.layer_split import (stage_layer_counts, stage_layer_range,
                                                         virtual_size_from_flags)
from megatron.training.arguments import parse_args
from megatron.training.run_config import ParallelConfig
from tests.unit_tests.test_bad_inputs_training import TINY, error_line

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"
PER_VIRTUAL, VIRTUAL = "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"
PP = "--pipeline-model-parallel-size"

# (num_layers, pipeline size, keyword arguments of stage_layer_counts, the counts)
SPLITS = [
    (8, 1, {}, [8]),
    (8, 2, {}, [4, 4]),
    (8, 4, {}, [2, 2, 2, 2]),
    (8, 2, {"virtual_size": 1}, [4, 4]),
    # uneven: the first / last rank alone, then both; the other ranks share what is left
    (8, 3, {"first_stage_layers": 2}, [2, 3, 3]),
    (7, 3, {"last_stage_layers": 1}, [3, 3, 1]),
    (8, 3, {"first_stage_layers": 3, "last_stage_layers": 1}, [3, 4, 1]),
    (8, 2, {"first_stage_layers": 5, "last_stage_layers": 3}, [5, 3]),
    (8, 3, {"first_stage_layers": 6, "last_stage_layers": 1}, [6, 1, 1]),
    # virtual stages: rank 0 chunk 0, rank 1 chunk 0, ..., rank 0 chunk 1, ...
    (8, 2, {"virtual_size": 2}, [2, 2, 2, 2]),
    (12, 2, {"virtual_size": 3}, [2, 2, 2, 2, 2, 2]),
    (8, 2, {"virtual_size": 2, "first_stage_layers": 6, "last_stage_layers": 2}, [3, 1, 3, 1]),
    (10, 3, {"virtual_size": 2, "first_stage_layers": 2, "last_stage_layers": 4}, [1, 2, 2, 1, 2, 2]),
    (14, 3, {"virtual_size": 2, "first_stage_layers": 2}, [1, 3, 3, 1, 3, 3]),
    # the embedding (loss) counts as one layer of the first (last) virtual stage
    (7, 2, {"account_for_embedding": True}, [3, 4]),
    (7, 2, {"account_for_loss": True}, [4, 3]),
    (6, 2, {"account_for_embedding": True, "account_for_loss": True}, [3, 3]),
    (5, 1, {"account_for_embedding": True, "account_for_loss": True}, [5]),
    (7, 2, {"virtual_size": 2, "account_for_embedding": True}, [1, 2, 2, 2]),
    (7, 2, {"virtual_size": 2, "account_for_loss": True}, [2, 2, 2, 1]),
    (6, 2, {"virtual_size": 2, "account_for_embedding": True, "account_for_loss": True}, [1, 2, 2, 1]),
]


@pytest.mark.parametrize("num_layers,pipeline_size,kwargs,expected", SPLITS)
def test_stage_layer_counts(num_layers, pipeline_size, kwargs, expected):
    assert stage_layer_counts(num_layers, pipeline_size, **kwargs) == expected


@pytest.mark.parametrize("num_layers,pipeline_size,kwargs,expected", SPLITS)
def test_ranges_cover_every_layer_once_in_virtual_stage_order(num_layers, pipeline_size, kwargs, expected):
    chunks = len(expected) // pipeline_size
    covered = []
    for stage in range(len(expected)):
        start, end = stage_layer_range(expected, pipeline_size, stage % pipeline_size, stage // pipeline_size)
        assert end - start == expected[stage]
        covered.extend(range(start, end))
    assert covered == list(range(num_layers))
    assert len(expected) == pipeline_size * chunks


def test_stage_layer_range_of_interleaved_chunks():
    counts = [2, 2, 2, 2]  # 8 layers, 2 ranks x 2 chunks
    assert stage_layer_range(counts, 2, 0) == (0, 2)
    assert stage_layer_range(counts, 2, 1) == (2, 4)
    assert stage_layer_range(counts, 2, 0, vp_stage=1) == (4, 6)
    assert stage_layer_range(counts, 2, 1, vp_stage=1) == (6, 8)
    assert stage_layer_range([3, 1, 3, 1], 2, 1, vp_stage=1) == (7, 8)
    for rank, vp_stage in ((2, 0), (0, 2), (-1, 0)):
        with pytest.raises(ValueError, match="outside 2 ranks x 2 chunks"):
            stage_layer_range(counts, 2, rank, vp_stage)


# (num_layers, pipeline size, keyword arguments, what the message must contain)
BAD_SPLITS = [
    (7, 2, {}, ["--num-layers 7 is not divisible by --pipeline-model-parallel-size 2", FIRST]),
    (8, 3, {"virtual_size": 2}, ["--num-layers 8", "--pipeline-model-parallel-size 3 x 2 virtual stages"]),
    (0, 1, {}, ["--num-layers 0 must be >= 1"]),
    (8, 0, {}, [f"{PP} 0 must be >= 1"]),
    (8, 1, {"virtual_size": 2}, [VIRTUAL, f"needs {PP} > 1"]),
    (8, 1, {"first_stage_layers": 4}, [FIRST, f"needs {PP} > 1"]),
    (8, 1, {"last_stage_layers": 4}, [LAST, f"needs {PP} > 1"]),
    (8, 2, {"first_stage_layers": 3, "last_stage_layers": 4}, [f"{FIRST} 3 + {LAST} 4 must equal --num-layers 8"]),
    (8, 2, {"first_stage_layers": 0}, [f"{FIRST} 0 must be >= 1"]),
    (8, 2, {"last_stage_layers": -1}, [f"{LAST} -1 must be >= 1"]),
    (8, 2, {"virtual_size": 2, "first_stage_layers": 3}, [f"{FIRST} 3 is not divisible", VIRTUAL]),
    (8, 2, {"virtual_size": 2, "last_stage_layers": 3}, [f"{LAST} 3 is not divisible", VIRTUAL]),
    (8, 3, {"first_stage_layers": 3}, [f"{FIRST} 3 leaves 5", "not divisible by the other 2 pipeline rank(s)"]),
    (8, 3, {"first_stage_layers": 7}, [f"{FIRST} 7 leaves 1", "fewer than one layer each"]),
    (8, 3, {"last_stage_layers": 1, "first_stage_layers": 6, "virtual_size": 2}, [f"{LAST} 1 is not divisible"]),
    (8, 2, {"account_for_embedding": True, "first_stage_layers": 4}, [f"{EMBEDDING} cannot be combined with {FIRST}",
                                                                      f"drop {EMBEDDING}"]),
    (8, 2, {"account_for_loss": True, "last_stage_layers": 4}, [f"{LOSS} cannot be combined", f"drop {LOSS}"]),
    (8, 2, {"account_for_embedding": True}, ["--num-layers 8 + 1", "drop the account-for flags"]),
    (1, 2, {"account_for_embedding": True}, [EMBEDDING, "virtual stage 0 (pipeline rank 0, chunk 0)"]),
    (3, 2, {"virtual_size": 2, "account_for_loss": True}, [LOSS, "virtual stage 3 (pipeline rank 1, chunk 1)"]),
    (2, 2, {"virtual_size": 2, "account_for_embedding": True, "account_for_loss": True},
     [f"{EMBEDDING} leaves virtual stage 0"]),
]


@pytest.mark.parametrize("num_layers,pipeline_size,kwargs,needles", BAD_SPLITS)
def test_bad_splits_name_the_flag(num_layers, pipeline_size, kwargs, needles):
    with pytest.raises(ValueError) as error:
        stage_layer_counts(num_layers, pipeline_size, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("num_layers,pipeline_size,per_stage,per_rank,expected", [
    (8, 2, None, None, None),
    (8, 2, 2, None, 2),
    (8, 2, 1, None, 4),
    (8, 2, 4, None, None),  # one chunk per rank: no interleaving
    (8, 2, None, 3, 3),
    (8, 2, None, 1, None),
    (8, 1, None, None, None),
])
def test_virtual_size_from_flags(num_layers, pipeline_size, per_stage, per_rank, expected):
    assert virtual_size_from_flags(num_layers, pipeline_size, per_stage, per_rank) == expected


@pytest.mark.parametrize("args,needles", [
    ((8, 2, 2, 2), [f"give only one of {PER_VIRTUAL} and {VIRTUAL}"]),
    ((8, 1, 2, None), [PER_VIRTUAL, f"needs {PP} > 1"]),
    ((8, 1, None, 2), [VIRTUAL, f"needs {PP} > 1"]),
    ((8, 2, 3, None), [f"{PP} 2 x {PER_VIRTUAL} 3 = 6"]),
    ((8, 2, 0, None), [f"{PER_VIRTUAL} 0 must be >= 1"]),
    ((8, 2, None, 0), [f"{VIRTUAL} 0 must be >= 1"]),
])
def test_bad_virtual_flags_name_the_flag(args, needles):
    with pytest.raises(ValueError) as error:
        virtual_size_from_flags(*args)
    for needle in needles:
        assert needle in str(error.value), str(error.value)


def _parse(argv, world_size):
    return parse_args(TINY + argv, add_difflm_args, world_size=world_size)


def test_the_flags_set_the_split_and_reach_the_parallel_config():
    args = _parse(["--num-layers", "8", PP, "2", VIRTUAL, "2", "--global-batch-size", "4"], world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.pipeline_layer_counts == [2, 2, 2, 2]
    parallel = ParallelConfig.from_args(args)  # the layout's one home in the RunConfig
    assert parallel.virtual_pipeline_model_parallel_size == 2 and parallel.pipeline_layer_counts == [2, 2, 2, 2]
    args = _parse(["--num-layers", "6", PP, "2", PER_VIRTUAL, "2", EMBEDDING, LOSS, "--global-batch-size", "2"],
                  world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2  # (6 + 2) / (2 x 2), as Megatron counts
    assert args.pipeline_layer_counts == [1, 2, 2, 1]
    args = _parse(["--num-layers", "8", PP, "3", FIRST, "3", LAST, "1"], world_size=3)
    assert args.virtual_pipeline_model_parallel_size is None and args.pipeline_layer_counts == [3, 4, 1]
    args = _parse(["--num-layers", "3"], world_size=1)
    assert args.virtual_pipeline_model_parallel_size is None and args.pipeline_layer_counts == [3]
    assert ParallelConfig.from_args(args).pipeline_layer_counts == [3]


@pytest.mark.parametrize("argv,world_size,needles", [
    (["--num-layers", "3", PP, "2"], 2, [f"--num-layers 3 is not divisible by {PP} 2"]),
    (["--num-layers", "8", PP, "2", PER_VIRTUAL, "2", VIRTUAL, "2"], 2, [f"give only one of {PER_VIRTUAL}"]),
    (["--num-layers", "8", VIRTUAL, "2"], 1, [f"{VIRTUAL} needs {PP} > 1"]),
    (["--num-layers", "8", PER_VIRTUAL, "2"], 1, [f"{PER_VIRTUAL} needs {PP} > 1"]),
    (["--num-layers", "4", PP, "2", VIRTUAL, "2", "--global-batch-size", "3"], 2,
     ["--global-batch-size 3 gives 3 micro-batches per replica", f"divisible by {PP} 2", "multiple of 2"]),
    (["--num-layers", "8", PP, "2", PER_VIRTUAL, "2", FIRST, "4"], 2, [f"{PER_VIRTUAL} cannot be combined", VIRTUAL]),
    (["--num-layers", "8", EMBEDDING], 1, [f"{EMBEDDING} has no effect without {PP} > 1"]),
    (["--num-layers", "8", LOSS], 1, [f"{LOSS} has no effect without {PP} > 1"]),
    (["--num-layers", "8", PP, "2", FIRST, "0"], 2, [f"{FIRST} 0 must be >= 1"]),
    (["--num-layers", "8", PP, "2", FIRST, "4", EMBEDDING], 2, [f"{EMBEDDING} cannot be combined"]),
])
def test_bad_pipeline_flags_exit_2_with_one_line(argv, world_size, needles, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv, world_size)
    assert exit_info.value.code == 2
    line = error_line(capsys.readouterr().err)
    for needle in needles:
        assert needle in line, line
