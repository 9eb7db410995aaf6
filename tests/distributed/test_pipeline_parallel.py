"""Pipeline parallelism equals one process: 1F1B, interleaved 1F1B, and PP composed with TP+SP,
DDP-style replicas, ZeRO-1 and FSDP2, in DLM (noshift and shift) and AR modes, with Megatron's
default configuration (biases, LayerNorm, GeLU, tied embeddings split over the first and last
stage) and the Llama style.

Every loss and every step-1 gradient must match the single-process run to 1e-5 (gloo, fp32),
over at least four micro-batches per step; packed documents (per-document attention and
positions) are on everywhere, variable-length DLM batches in their own case.
"""

import os
import weakref

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.training.initialize import initialize_distributed
from megatron.training.run_config import parse_run_config
from megatron.training.training import build_trainer
from tests.distributed.parity import LayoutCases, free_port, start_workers
from tests.distributed.test_layout_matrix import CONFIGS, GQA, MODES, SHAPE

pytestmark = pytest.mark.distributed

FOUR_LAYERS = [flag if flag != "2" or SHAPE[i - 1] != "--num-layers" else "4" for i, flag in enumerate(SHAPE)]
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "8"]
VARILEN = ("--difflm-varilen-prob", "0.5")
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]

SHIFT = ("--model-running-mode", "difflm-shift")  # replaces the dlm mode's noshift (the later flag wins)
CASES = [("megatron", "dlm", ()), ("megatron", "ar", ()), ("llama", "dlm", ()), ("llama", "ar", ()),
         ("megatron", "dlm", VARILEN), ("llama", "dlm", VARILEN), ("megatron", "dlm", SHIFT), ("gpt3", "dlm", ()),
         ("gpt3", "ar", ())]
# layout: (world size, parallel flags, the cases it trains, gradients compared by name)
LAYOUTS = {
    "pp2": (2, PP2, CASES[:5] + CASES[7:9], False),
    "pp4": (4, PP4, [CASES[0], CASES[3]], False),
    "pp2_interleaved": (2, PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"],
                        [CASES[0], CASES[3], CASES[5]], False),
    "pp2_uneven": (2, PP2 + ["--decoder-first-pipeline-num-layers", "1"], [CASES[1], CASES[2]], False),
    "pp2_tp2_sp": (4, PP2 + TP2_SP, [CASES[0], CASES[1], CASES[2], CASES[4], CASES[8]], False),
    "pp2_dp2_zero1": (4, PP2 + ["--use-distributed-optimizer"], [CASES[0], CASES[3]], False),
    "pp2_dp2": (4, PP2, [CASES[6], CASES[1]], False),
    "pp2_dp2_fsdp2": (4, PP2 + ["--data-parallel-sharding-strategy", "optim_grads_params"],
                      [CASES[1], CASES[4]], True),
    "pp2_dp2_zero2_recompute": (4, PP2 + ["--data-parallel-sharding-strategy", "optim_grads",
                                          "--recompute-granularity", "full", "--recompute-method", "uniform",
                                          "--recompute-num-layers", "1"], [CASES[2], CASES[3]], True),
    "pp2_compile": (2, PP2 + ["--torch-compile"], [CASES[5]], False),
}


def argv_of(config: str, mode: str, extra: list) -> list:
    """The case's command line; "megatron" here is Megatron's default configuration (biases, LayerNorm,
    GeLU, tied embeddings) with grouped-query attention (2 kv heads for 4 query heads)."""
    return FOUR_LAYERS + BATCH + (GQA if config == "megatron" else CONFIGS[config]) + MODES[mode] + list(extra)


SUITE = LayoutCases(LAYOUTS, argv_of)


references = SUITE.references_fixture()


@pytest.mark.parametrize("world_size", SUITE.world_sizes())
def test_pipeline_layouts_match_one_process(world_size, references, tmp_path):
    """Every layout of LAYOUTS with `world_size` processes, each case against its single-process run."""
    for layout, results in SUITE.check(world_size, references, tmp_path).items():
        assert all(result["microbatches"] >= 4 for result in results), layout


class _LiveActivations:
    """Saved tensors of the autograd graph, by the micro-batch whose forward saved them, while alive."""

    def __init__(self):
        self.live, self.microbatch, self.peak = {}, None, 0

    def pack(self, tensor):
        holder = _Holder(tensor)
        mb = self.microbatch
        self.live[mb] = self.live.get(mb, 0) + 1
        weakref.finalize(holder, self._release, mb)
        self.note()
        return holder

    def _release(self, mb):
        self.live[mb] -= 1

    def note(self):
        self.peak = max(self.peak, sum(1 for count in self.live.values() if count > 0))


class _Holder:
    def __init__(self, tensor):
        self.tensor = tensor


def _memory_worker(rank, world_size, port, argv, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    trainer = build_trainer(parse_run_config(argv, add_difflm_args), initialize_distributed("gloo"),
                            pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                            pretrain_difflm.forward_step)
    tracker, forward_step = _LiveActivations(), trainer.forward_step

    def counting_forward_step(iterator, model, ctx):
        tracker.microbatch = ctx.microbatch
        return forward_step(iterator, model, ctx)

    trainer.forward_step = counting_forward_step
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda holder: holder.tensor):
        trainer.train_step(trainer.train_loader(0))
    torch.save(tracker.peak, f"{out}.{rank}")


def test_one_f_one_b_stage_holds_at_most_p_micro_batches_of_activations(tmp_path):
    """PP=4 with 8 micro-batches: counted on the live saved tensors of the autograd graph, stage s
    holds the activations of at most 4 - s micro-batches at once (GPipe would hold all 8)."""
    argv = argv_of("megatron", "dlm", ()) + PP4 + ["--train-iters", "1"]
    out = str(tmp_path / "peak")
    start_workers(_memory_worker, (4, free_port(), argv, out), 4)
    peaks = [torch.load(f"{out}.{rank}") for rank in range(4)]
    assert peaks == [4, 3, 2, 1], peaks


def _dropout_worker(rank, world_size, port, argvs, out):
    """One training step of each command line; every dropout mask this rank drew, in order."""
    from tests.distributed.dropout_masks import recorded_masks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    runtime, drawn = initialize_distributed("gloo"), []
    for argv in argvs:
        trainer = build_trainer(parse_run_config(argv, add_difflm_args), runtime,
                                pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                                pretrain_difflm.forward_step)
        with recorded_masks() as masks:
            trainer.train_step(trainer.train_loader(0))
        drawn.append(masks)
    torch.save(drawn, f"{out}.{rank}")


ATTENTION_DROPOUT = ["--attention-dropout", "0.3", "--train-iters", "1"]
DROPOUT = ATTENTION_DROPOUT + ["--hidden-dropout", "0.3"]
VIRTUAL = ["--num-virtual-stages-per-pipeline-rank", "2"]
# world size: [(name, command line, the ranks of each stage)]
DROPOUT_LAYOUTS = {
    2: [("pp2 attention only", argv_of("megatron", "dlm", ()) + PP2 + ATTENTION_DROPOUT, [[0], [1]]),
        ("pp2", argv_of("megatron", "dlm", ()) + PP2 + DROPOUT, [[0], [1]]),
        ("pp2 x 2 virtual stages", argv_of("megatron", "dlm", ()) + PP2 + VIRTUAL + DROPOUT, [[0], [1]])],
    4: [("pp2 tp2", argv_of("megatron", "dlm", ()) + PP2 + ["--tensor-model-parallel-size", "2"] + DROPOUT,
         [[0, 1], [2, 3]])],
}


@pytest.mark.parametrize("world_size", sorted(DROPOUT_LAYOUTS))
def test_pipeline_stages_and_virtual_stages_draw_their_own_dropout_masks(world_size, tmp_path):
    """Stages run the same shapes in the same order, so with one seed stage 1 would draw stage 0's masks
    bit for bit (attention dropout in the tp region too). Each stage seeds seed + 100 x its rank, as
    Megatron does, and the virtual stages of a rank draw on from its streams: over one step of 8
    micro-batches no mask of one stage appears on another, nor twice on a rank."""
    from tests.distributed.dropout_masks import shared_masks

    layouts = DROPOUT_LAYOUTS[world_size]
    out = str(tmp_path / "masks")
    start_workers(_dropout_worker, (world_size, free_port(), [argv for _, argv, _ in layouts], out), world_size)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(world_size)]
    for index, (name, _, stages) in enumerate(layouts):
        first, second = ([mask for rank in stage for mask in ranks[rank][index]] for stage in stages)
        assert len(first) >= 8 and len(second) >= 8, name
        assert shared_masks(first, second) == [], f"{name}: a stage repeats the other's dropout masks"
        for rank in stages[0] + stages[1]:
            masks = ranks[rank][index]
            assert [(i, j) for i, j in shared_masks(masks, masks) if i < j] == [], f"{name}: rank {rank} repeats"
