"""The launch scripts' flags pass validation at the layout each script is written for.

Each script runs with a stand-in `torchrun` on PATH that records its arguments
(tests/launch_flags.py); the flags after `pretrain_difflm.py` are then validated by
`parse_args` at the script's world size, so a flag the parser refuses, a layout the world size
cannot hold or a batch the layout cannot split fails here rather than on a cluster.
"""

import pytest

from custom_args.difflm import add_difflm_args
from megatron.training.arguments import parse_args
from tests.launch_flags import recorded_flags

# script: (GPUs it is written for, what the run must resolve to)
SCRIPTS = {
    "examples/dlm_training/dlm_pretrain_7b.sh": (8, {"tensor_model_parallel_size": 2,
                                                     "pipeline_model_parallel_size": 2, "data_parallel_size": 2,
                                                     "sequence_parallel": True}),
    "examples/dlm_training/dlm_pretrain_1.7b.sh": (1, {"pipeline_model_parallel_size": 1}),
    "examples/dlm_training/dlm_pretrain_125m.sh": (1, {"pipeline_model_parallel_size": 1}),
    "examples/ar_training/ar_pretrain_1.7b.sh": (1, {"model_running_mode": "vanilla"}),
    "examples/dlm_training/dlm_sft_1.7b.sh": (1, {"sft": True, "difflm_loss_normalizer": "sequence"}),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_launch_script_flags_validate_at_its_layout(script, tmp_path):
    gpus, expected = SCRIPTS[script]
    flags = recorded_flags(script, tmp_path, {"GPUS_PER_NODE": str(gpus), "TENSORBOARD_DIR": str(tmp_path / "tb")})
    args = parse_args(flags, add_difflm_args, world_size=gpus)
    for name, value in expected.items():
        assert getattr(args, name) == value, (name, getattr(args, name))
