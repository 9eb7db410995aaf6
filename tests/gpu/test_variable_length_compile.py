"""On a GPU, micro-batches cut to random lengths (--difflm-varilen-prob) reuse the compiled layers' graph.

The 1.7B launch script stalled 2-6 s at each step with a cut micro-batch on an H100: the layers were
compiled with a symbolic length, yet Inductor's mix-order reduction (RMSNorm's backward) guarded its
fusion on length thresholds (1280, 2048, 2560 tokens at hidden 2048 and 2 rows), so each new range of
lengths compiled the layer again, forward and backward. `tests/unit_tests/test_compile_recompiles.py`
covers the rest of the run's compiled functions on a CPU, where that fusion does not exist. Here one
layer of the 1.7B model's width trains 4096-token micro-batches, then micro-batches cut below each
threshold, and dynamo's count of graphs must not grow after the first two steps (the first step compiles
the layer with no weight gradient yet, the second with one).
"""

import torch
import torch._dynamo.utils

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.models.difflm.diffusion import varilen_length
from megatron.training.run_config import parse_run_config
from megatron.training.training import build_trainer
from tests.gpu.harness import DEVICE, SUITE, isolated_state, runtime

pytestmark = SUITE

SEQ, MICRO, GLOBAL, STEPS = 4096, 2, 4, 5
# The 1.7B shape's width (hidden 2048, 16 heads / 8 kv heads of 128) in one layer; its precision, attention
# and loss flags. At this seed steps 0 and 1 are uncut and steps 2-4 cut to 2000, 1224 and 2336 tokens
# (asserted below): one length in each range below the full one's.
FLAGS = ["--num-layers", "1", "--hidden-size", "2048", "--ffn-hidden-size", "2048", "--num-attention-heads", "16",
         "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-6", "--qk-layernorm", "--swiglu", "--disable-bias-linear",
         "--position-embedding-type", "rope", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
         "--mock-data", "--vocab-size", "1024", "--add-mask-token", "--attention-dropout", "0.0",
         "--hidden-dropout", "0.0", "--bf16", "--torch-compile", "--difflm-masked-only-loss",
         "--difflm-compile-loss", "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
         "--train-iters", str(STEPS), "--lr", "1e-4", "--log-interval", "1000", "--eval-iters", "0",
         "--seed", "370", "--difflm-varilen-prob", "0.5"]


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_cut_micro_batches_of_every_length_reuse_the_compiled_layer():
    config = parse_run_config(FLAGS, add_difflm_args, world_size=1)
    dlm = config.dlm
    lengths = [min(varilen_length(dlm, step, position, SEQ, dlm.varilen_multiple)
                   for position in range(0, GLOBAL, MICRO)) for step in range(STEPS)]
    assert lengths[:2] == [SEQ, SEQ] and lengths[2] < 2048 and lengths[3] < 1280 and 2048 <= lengths[4] < 2560, lengths
    with isolated_state(DEVICE):
        trainer = build_trainer(config, runtime(), pretrain_difflm.train_valid_test_datasets_provider,
                                pretrain_difflm.model_provider, pretrain_difflm.forward_step)
        counts, step = [], trainer.train_step

        def counting_step(data_iterator):
            result = step(data_iterator)
            counts.append(graphs())
            return result

        trainer.train_step = counting_step
        trainer.train()
        trainer.logger.close()
    assert len(counts) == STEPS
    assert counts[2:] == [counts[1]] * (STEPS - 2), f"dynamo's graphs after each step: {counts}"
