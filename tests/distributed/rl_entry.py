"""A training entry whose batches are fixed rollouts, for the RL parity suite (test_rl_parity.py): the
model provider is pretrain_difflm's, each sample a prompt and completion with its advantage, the log-probs
of the policy that sampled it and its estimator seed, all a pure function of the sample index, and the
forward step is megatron/rl/step.py's. The estimator follows the policy: exact `ar` for a vanilla model,
`ar_order` for a block-diffusion one, SPG's sandwiched bounds for a difflm-shift one (two block-masked
copies a row), `diffu_grpo` otherwise."""

import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.models.difflm.batch import VOCAB_FIX  # noqa: F401 (the model's id checks apply to these ids)
from megatron.rl.step import RLConfig, RolloutBatch, rl_forward_step

model_provider = pretrain_difflm.model_provider
extra_args_provider = add_difflm_args
PROMPT = 8
TEXT_VOCAB = 100  # ids the rollouts use: below every test vocabulary and its mask token


class RolloutRows(torch.utils.data.Dataset):
    """`size` rollouts of `seq_length` tokens (PROMPT of prompt), each a function of its index."""

    def __init__(self, size: int, seq_length: int) -> None:
        self.size, self.seq_length = size, seq_length

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(1000 + index)
        completion = self.seq_length - PROMPT
        mask = torch.ones(completion, dtype=torch.bool)
        mask[completion - index % 3:] = False  # some completions end early
        return {"tokens": torch.randint(0, TEXT_VOCAB, (self.seq_length,), generator=generator),
                "completion_mask": mask, "advantage": torch.tensor(float(index % 4) - 1.5),
                "old_logp": -4.0 - 0.05 * torch.arange(completion, dtype=torch.float32) + 0.1 * (index % 2),
                "seed": torch.tensor(index)}


def train_valid_test_datasets_provider(config, sizes):
    return RolloutRows(sizes[0], config.data.seq_length), None, None


def forward_step(data_iterator, model, ctx, config):
    sample = next(data_iterator)
    device = next(model.parameters()).device
    dlm = config.dlm
    estimator = "ar" if not dlm.is_diffusion else ("ar_order" if dlm.block_diffusion else
                                                   "spg" if dlm.model_running_mode == "difflm-shift" else "diffu_grpo")
    rl = RLConfig(estimator=estimator, mask_token_id=dlm.mask_token_id, clip_high=0.28, beta=0.0,
                  spg_block_length=4).validate()
    batch = RolloutBatch(sample["tokens"].to(device), PROMPT, sample["completion_mask"].to(device),
                         sample["advantage"].to(device), sample["old_logp"].to(device), sample["seed"])
    return rl_forward_step(batch, model, rl)
