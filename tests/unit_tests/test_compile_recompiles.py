"""The compiled functions of a training run compile in its first steps and never again.

The 1.7B launch script stalled once mid-run (about 10 s on an H100, iterations 11-15 of a short run):
its first --difflm-varilen-prob micro-batch, cut to a random length, recompiled the compiled
transformer layers for a symbolic length. The learning rate's warmup -> stable -> decay, suspected
first, changes nothing compiled (CompiledAdamW reads it as a device tensor). Here a tiny model runs
the script's optimizer and loss flags through the trainer over a schedule crossing all three phases,
with micro-batches cut to two lengths after the first steps, and counts dynamo's graphs.
"""

import torch
import torch._dynamo.utils

from custom_args.difflm import add_difflm_args
from megatron.core.models.difflm.diffusion import varilen_length
from megatron.training.arguments import parse_args
from tests.distributed.parity import TINY_GQA
from tests.unit_tests.test_training import make_trainer

SEQ, MICRO, GLOBAL, STEPS = 32, 2, 4, 8
# The 1.7B script's optimizer, precision and loss flags; a WSD schedule of 2 warmup, 3 stable, 3 decay steps.
LAUNCH_FLAGS = ["--bf16", "--compile-optimizer-step", "--cache-low-precision-weights",
                "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
                "--clip-grad", "1.0", "--weight-decay", "0.1", "--lr", "2e-4", "--min-lr", "2e-5",
                "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "exponential", "--lr-warmup-iters", "2",
                "--lr-wsd-decay-iters", "3", "--difflm-masked-only-loss", "--difflm-compile-loss", "--torch-compile",
                "--difflm-t-sampling", "antithetic", "--micro-batch-size", str(MICRO),
                "--global-batch-size", str(GLOBAL), "--train-iters", str(STEPS)]
# At this seed and rate no micro-batch of the first 3 steps is cut, and steps 4 and 8 each cut one (to 16
# and 8 tokens): asserted below, so the test cannot pass for want of a cut.
VARILEN = ["--seed", "1284", "--difflm-varilen-prob", "0.2"]


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_no_compilation_after_the_first_steps_across_warmup_stable_and_decay(runtime):
    flags = TINY_GQA[:-2] + LAUNCH_FLAGS + VARILEN  # TINY_GQA ends with its --train-iters
    dlm = parse_args(flags, add_difflm_args, world_size=1).dlm_config
    trainer = make_trainer(runtime, base=flags)
    lengths = [[varilen_length(dlm, step, position, SEQ, dlm.varilen_multiple) for position in range(0, GLOBAL, MICRO)]
               for step in range(STEPS)]
    cut = [min(step_lengths) for step_lengths in lengths]
    assert cut[:3] == [SEQ] * 3 and len({length for length in cut[3:] if length < SEQ}) == 2, cut

    learning_rates, counts, step = [], [], trainer.train_step

    def counting_step(data_iterator):
        result = step(data_iterator)
        learning_rates.append(trainer.optimizer.param_groups[0]["lr"])
        counts.append(graphs())
        return result

    trainer.train_step = counting_step
    trainer.train()
    assert len(counts) == STEPS
    warmup, stable, decay = learning_rates[:2], learning_rates[2:5], learning_rates[5:]
    assert warmup[0] < warmup[1] == stable[0] == stable[-1] > decay[0] > decay[-1], learning_rates
    assert counts[2:] == [counts[1]] * (STEPS - 2), f"graphs after each step: {counts}"
