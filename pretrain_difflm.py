"""Pretrain a masked diffusion LM (or an AR LM with --model-running-mode vanilla).

    torchrun --nproc_per_node=8 pretrain_difflm.py --num-layers 24 ... \
        --model-running-mode difflm-noshift --attention-mask-type no_mask

The three functions Megatron users know: `model_provider`, `forward_step` (with its
`loss_func`) and `train_valid_test_datasets_provider`; each receives the run's typed configs, a
RunConfig (megatron/training/run_config.py), not the flags' Namespace. The corruption happens here, on the
data side, keyed by each sample's index in its stream: `forward_step` builds the key and hands
the clean batch to megatron/core/models/difflm/objective.py (`loss_inputs`, the one path from a
clean batch to the model's input, loss weights and normalizer; diffusion.py is the process).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from custom_args.difflm import add_difflm_args
from megatron.core.datasets.dataset_builder import DatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.mock_dataset import MockGPTDataset, mock_sft_examples
from megatron.core.datasets.sft_dataset import SFTDataset, SFTDatasetConfig
from megatron.core.models.difflm import diffusion, objective
from megatron.core.models.difflm.batch import check_token_ids, document_ids_from_eod, positions_from_documents
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.parallel_state import ProcessGroups
from megatron.training import pretrain
from megatron.training.run_config import RunConfig
from megatron.training.step_state import StepContext


def model_provider(config: RunConfig, pre_process: bool = True, post_process: bool = True,
                   pg: Optional[ProcessGroups] = None, layer_range: Optional[Tuple[int, int]] = None) -> GPTModel:
    """The model, or the pipeline stage holding layers [start, end) of `layer_range` (pre_process:
    it holds the embedding; post_process: the output layer)."""
    # get_batch checks every batch's ids on the host before the copy, so the model need not read
    # them back from the device (a host sync per micro-batch); it keeps a device-side assert.
    return GPTModel(config.model.replace(check_token_ids=False), config.dlm, pre_process=pre_process,
                    post_process=post_process, layer_range=layer_range, pg=pg)


def train_valid_test_datasets_provider(config: RunConfig, num_samples: List[int]):
    """Train, valid and test datasets of num_samples[i] samples each (None where 0); with --sft,
    rows of chat examples (megatron/core/datasets/sft_dataset.py)."""
    data = config.data
    eod = data.tokenizer.eod
    sft = SFTDatasetConfig(data.seq_length, eod, data.sft_padding, data.seed) if data.sft else None
    if data.mock_data:
        def mock(count: int, split: str):
            if sft is not None:
                examples = mock_sft_examples(data.seq_length, eod, eod, data.seed, split)
                return SFTDataset(*examples, count, sft, name=f"mock {split}")
            return MockGPTDataset(count, data.seq_length, text_vocab_size=eod, eod=eod, seed=data.seed, split=split)
        return tuple(mock(count, split) if count else None
                     for count, split in zip(num_samples, ("train", "valid", "test")))
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    # Rank 0 builds the index files; the others wait at the barrier and read them.
    # Every piece read is checked against the tokenizer's own ids: the padding rows (and an appended
    # mask token) are never data.
    builder = DatasetBuilder(GPTDatasetConfig(data.seq_length, data.seed, data.data_cache_path,
                                               mmap_bin_files=not data.no_mmap_bin_files,
                                               vocab_size=data.tokenizer.base_vocab_size),
                             barrier=dist.barrier if distributed else None,
                             is_builder=not distributed or dist.get_rank() == 0, sft=sft)
    if data.data_path:
        return tuple(builder.from_split(data.data_path, data.split, num_samples))
    paths = [data.train_data_path, data.valid_data_path, data.test_data_path]
    return tuple(builder.from_split_paths(paths, num_samples))


def get_batch(data_iterator: Iterator, config: RunConfig, ctx: StepContext,
              device: torch.device) -> Dict[str, Optional[torch.Tensor]]:
    """Tokens, targets, loss mask and packing metadata of one micro-batch on `device`."""
    sample, data, dlm = next(data_iterator), config.data, config.dlm.at_iteration(ctx.schedule_iteration)
    # Still on the host: the range check costs no device sync here (the model skips its own).
    check_token_ids("tokens", sample["tokens"], data.padded_vocab_size)
    tokens = sample["tokens"].to(device, non_blocking=True)
    length = data.seq_length
    if dlm.is_diffusion and ctx.training and dlm.varilen_prob > 0:
        # Keyed by where this micro-batch sits in the global batch, not by rank or accumulation
        # step: the same cut in every layout, the same on every rank (no stragglers). The multiple
        # is the run's, never the layout's (arguments.py checks that SP can split it).
        multiple = dlm.varilen_multiple
        if dlm.effective_mask_type in ("block_causal", "block_diffusion"):
            multiple = math.lcm(multiple, dlm.block_size)
        first_position = int(sample["index"][0]) - ctx.first_sample_index
        length = diffusion.varilen_length(dlm, ctx.iteration, first_position, length,
                                          multiple_of=multiple)
    inputs = tokens[:, :length]
    # DLMs predict the tokens they see (corrupted); AR models predict the next token.
    labels = inputs if dlm.is_diffusion else tokens[:, 1:length + 1]
    eod = data.tokenizer.eod
    loss_mask = (labels != eod) if data.eod_mask_loss else torch.ones_like(labels, dtype=torch.bool)
    if data.sft:
        return _sft_batch(sample, config, inputs, labels, loss_mask, device)
    documents = document_ids_from_eod(inputs, eod) if (data.reset_attention_mask or data.reset_position_ids) else None
    position_ids = positions_from_documents(documents) if data.reset_position_ids else None
    return {"inputs": inputs, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "document_ids": documents if data.reset_attention_mask else None,
            "index": sample["index"].to(device)}


def _sft_batch(sample: Dict[str, torch.Tensor], config: RunConfig, inputs: torch.Tensor,
               labels: torch.Tensor, loss_mask: torch.Tensor, device: torch.device) -> Dict[str, torch.Tensor]:
    """get_batch with --sft: only answer positions carry a loss (in the DLM modes only they are
    maskable: the prompt stays clean), and packed rows attend inside each example."""
    length = inputs.shape[1]
    answer = sample["answer"].to(device, non_blocking=True)
    if config.dlm.is_diffusion:
        loss_mask = loss_mask & answer[:, :length]
    else:  # the label at i is token i + 1; AR fine-tuning leaves the EOD padding out
        padding = sample["padding"].to(device, non_blocking=True)
        loss_mask = loss_mask & (answer & ~padding)[:, 1:length + 1]
    documents = position_ids = None
    if config.data.sft_padding == "pack":
        documents = sample["document_ids"].to(device, non_blocking=True)[:, :length]
        position_ids = positions_from_documents(documents)
    return {"inputs": inputs, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "document_ids": documents, "index": sample["index"].to(device)}


def loss_func(normalizer: torch.Tensor, output) -> Tuple[torch.Tensor, ...]:
    """(sum of weighted token losses, loss tokens): the loop divides once per global batch. With
    auxiliary terms (objective.auxiliary_terms) `output` is (loss sum, their sums): then also the sums
    of objective.loss_parts, the diffusion term first, for the log."""
    if not isinstance(output, tuple):
        return output, normalizer
    loss_sum, terms = output
    return loss_sum, normalizer, torch.cat([(loss_sum.detach() - terms.sum()).reshape(1), terms])


def forward_step(data_iterator: Iterator, model: nn.Module, ctx: StepContext, config: RunConfig):
    """One micro-batch: its loss sum on the last pipeline stage (or without pipelining), the
    hidden states for the next stage elsewhere. Every stage reads the batch and derives the
    same corruption; a stage after the first takes its input from the previous one."""
    device = next(model.parameters()).device
    batch = get_batch(data_iterator, config, ctx, device)
    dlm = config.dlm.at_iteration(ctx.schedule_iteration)  # the block-size curriculum's size of this step
    key = None
    if dlm.is_diffusion:
        key = diffusion.CorruptionKey(
            seed=dlm.seed, sample_index=batch["index"], batch_position=batch["index"] - ctx.first_sample_index,
            global_batch_size=ctx.global_batch_size, iteration=ctx.iteration, stream=ctx.stream)
    # Unclamped: the loop sums the normalizers of all micro-batches and replicas and divides once
    # (GPTModel.compute_loss, scoring one batch alone, clamps its own; objective.py says more).
    model_input, weights, normalizer, _ = objective.loss_inputs(
        batch["inputs"], dlm, key, batch["loss_mask"], batch["document_ids"], clamp_normalizer=False)
    # A normalizer of 1 makes the model return the weighted sum itself: its gradient then flows
    # through the model's loss, which the masked-only output layer prepares in its forward.
    # MoE balancing losses enter the summed loss with the micro-batch's normalizer as weight
    # (megatron/core/transformer/moe/aux_losses.py), times fp16's loss scale like the loss itself.
    aux_loss_scale = normalizer if ctx.loss_scale is None else normalizer * ctx.loss_scale
    scheduled = {} if dlm is config.dlm else {"block_size": dlm.block_size}
    ar_weights = objective.joint_ar_weights(batch["inputs"], dlm, batch["loss_mask"])  # joint AR + DLM only
    joint = {} if ar_weights is None else {"ar_loss_weights": ar_weights}
    output = model(model_input, position_ids=batch["position_ids"], labels=batch["labels"],
                   loss_weights=weights, loss_normalizer=1.0, document_ids=batch["document_ids"],
                   aux_loss_scale=aux_loss_scale, **scheduled, **joint)
    # The last stage returns (per-token losses, loss sum[, auxiliary terms' sums]); the others hidden states.
    if isinstance(output, tuple):
        output = output[1] if len(output) == 2 else output[1:]
    return output, partial(loss_func, normalizer)


def main(argv: Optional[List[str]] = None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                    extra_args_provider=add_difflm_args, argv=argv)


if __name__ == "__main__":
    main()
