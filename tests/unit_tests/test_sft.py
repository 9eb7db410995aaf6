"""Supervised fine-tuning (--sft): the rows SFTDataset makes, what get_batch and the objective
make of them in every mode (the prompt is never masked and carries no loss), each
--sft-normalizer recipe against its formula written out by hand, and the flag rules."""

import numpy as np
import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_answer_prefix
from megatron.core.datasets.sft_dataset import SFTDataset, SFTDatasetConfig, pack_rows
from megatron.core.models.difflm import objective
from megatron.training.run_config import parse_run_config
from megatron.training.step_state import StepContext
from tests.unit_tests.test_bad_inputs_training import MODEL, NULL_TOKENIZER, TINY, parse_error, write_corpus

EOD = 9
MODES = ["difflm-noshift", "difflm-shift", "vanilla"]


def examples():
    """Three hand-made examples: (ids, answer flags)."""
    data = [([1, 2, 3, 4, 5, EOD], [0, 0, 0, 1, 1, 1]), ([6, 7, EOD], [0, 1, 1]),
            ([1, 1, 2, 2, 3, 3, 4, 4, 5, EOD], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1])]
    lengths = np.array([len(ids) for ids, _ in data])
    return lengths, lambda j: (np.array(data[j][0]), np.array(data[j][1], dtype=np.uint8))


def test_eos_rows_hold_one_example_padded_with_trained_eod():
    lengths, get = examples()
    dataset = SFTDataset(lengths, get, 5, SFTDatasetConfig(seq_length=7, eod=EOD, padding="eos", seed=3))
    assert len(dataset) >= 5
    seen = set()
    for index in range(3):  # the first epoch: every example once
        row, example = dataset[index], int(dataset.rows[index])
        ids, flags = get(example)
        seen.add(example)
        n = min(len(ids), 8)
        assert row["tokens"][:n].tolist() == ids[:n].tolist()
        assert row["answer"][:n].tolist() == flags[:n].astype(bool).tolist()
        assert (row["tokens"][n:] == EOD).all() and row["answer"][n:].all() and row["padding"][n:].all()
        assert not row["padding"][:n].any()
    assert seen == {0, 1, 2}
    assert dataset.truncated == 1  # the 10-token example is cut to the 8 tokens of a row


def test_packed_rows_keep_examples_whole_and_apart():
    lengths, get = examples()
    assert [r.tolist() for r in pack_rows(lengths, np.array([0, 1, 2]), capacity=9)] == [[0, 1], [2]]
    dataset = SFTDataset(lengths, get, 4, SFTDatasetConfig(seq_length=9, eod=EOD, padding="pack", seed=0))
    for index in range(len(dataset)):
        row, members, start = dataset[index], dataset.rows[index].tolist(), 0
        for number, example in enumerate(members):
            ids, flags = get(example)
            n = min(len(ids), 9)
            assert row["tokens"][start:start + n].tolist() == ids[:n].tolist()
            assert row["answer"][start:start + n].tolist() == flags[:n].astype(bool).tolist()
            assert (row["document_ids"][start:start + n] == number).all()
            start += n
        # The filler: never an answer, its own document, and at least the last token (the AR shift's).
        assert start <= 9 and row["padding"][start:].all() and not row["answer"][start:].any()
        assert (row["document_ids"][start:] == len(members)).all()


def sft_batch(mode, *extra, batch=4):
    """(RunConfig, batch dict from get_batch, answer flags of the label positions)."""
    config = parse_run_config(TINY + ["--sft", "--model-running-mode", mode, "--micro-batch-size", str(batch),
                                      "--global-batch-size", str(batch), "--seq-length", "24", *extra],
                              add_difflm_args, world_size=1)
    train, _, _ = pretrain_difflm.train_valid_test_datasets_provider(config, [batch, 0, 0])
    rows = [train[i] for i in range(batch)]
    sample = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    ctx = StepContext(iteration=1, first_sample_index=0, global_batch_size=batch, microbatch=0)
    out = pretrain_difflm.get_batch(iter([sample]), config, ctx, torch.device("cpu"))
    length = out["inputs"].shape[1]
    answer = sample["answer"][:, :length]
    if mode == "vanilla":  # the labels: the next tokens, without the EOD padding
        answer = (sample["answer"] & ~sample["padding"])[:, 1:length + 1]
    return config, out, answer


def loss_inputs(config, batch):
    key = objective.CorruptionKey.for_batch(config.dlm.seed, 1, batch["inputs"].shape[0], 0, batch["inputs"].shape[0])
    return objective.loss_inputs(batch["inputs"], config.dlm, key, batch["loss_mask"], batch["document_ids"],
                                 clamp_normalizer=False)


@pytest.mark.parametrize("padding", ["eos", "pack"])
@pytest.mark.parametrize("mode", MODES)
def test_prompt_tokens_are_never_masked_and_carry_no_loss(mode, padding):
    for recipe in (["llada", "dllm", "dfactory"] if mode != "vanilla" else [None]):
        recipe_flags = ["--sft-normalizer", recipe] if recipe else []
        config, batch, answer = sft_batch(mode, "--sft-padding", padding, *recipe_flags)
        model_input, weights, normalizer, corruption = loss_inputs(config, batch)
        assert (weights[~answer] == 0).all(), (mode, padding, recipe)
        assert (weights[answer] > 0).any() and normalizer > 0
        if mode != "vanilla":
            prompt = ~answer
            assert not corruption.masked_positions[prompt].any()
            assert torch.equal(model_input[prompt], batch["inputs"][prompt])
        if padding == "pack":  # attention and positions restart at every example
            assert batch["document_ids"] is not None and (batch["position_ids"][batch["document_ids"] == 1] >= 0).all()
            first = torch.nonzero(batch["document_ids"][0] == 1)[0, 0]
            assert batch["position_ids"][0, first] == 0


@pytest.mark.parametrize("recipe", ["llada", "dllm", "dfactory"])
def test_each_recipe_equals_its_formula_by_hand(recipe):
    config, batch, answer = sft_batch("difflm-noshift", "--sft-normalizer", recipe, batch=6)
    _, weights, normalizer, corruption = loss_inputs(config, batch)
    ce = torch.rand(weights.shape, generator=torch.Generator().manual_seed(0)) * 3
    loss = float((ce * weights).sum() / normalizer)
    masked, p = corruption.masked_positions.tolist(), corruption.p_mask.tolist()
    rows = range(len(masked))
    answers = [int(answer[r].sum()) for r in rows]
    term = [[float(ce[r, j]) / (p[r][j] if recipe != "dfactory" else 1.0) for j in range(len(masked[r]))
             if masked[r][j]] for r in rows]
    if recipe == "llada":   # each row by its answer length, then the mean over rows
        expected = sum(sum(term[r]) / answers[r] for r in rows if answers[r]) / sum(1 for a in answers if a)
    elif recipe == "dllm":  # all answer tokens of the batch
        expected = sum(map(sum, term)) / sum(answers)
    else:                   # plain mean over the masked tokens, t in [0.3, 0.8)
        expected = sum(map(sum, term)) / sum(map(len, term))
        eps = config.dlm.eps
        picked = corruption.p_mask[answer]
        assert picked.min() >= 0.3 * (1 - eps) + eps - 1e-6 and picked.max() < 0.8 * (1 - eps) + eps
    assert loss == pytest.approx(expected, rel=1e-6)


def test_ar_fine_tuning_averages_the_answer_tokens():
    config, batch, answer = sft_batch("vanilla", batch=6)
    _, weights, normalizer, _ = loss_inputs(config, batch)
    assert torch.equal(weights.bool(), answer) and normalizer == answer.sum()


@pytest.mark.parametrize("extra, message", [
    (["--sft", "--reset-attention-mask"], "--sft-padding pack"),
    (["--sft", "--sft-normalizer", "llada", "--difflm-loss-weight", "none"], "give one of them"),
    (["--sft-padding", "pack"], "--sft-padding has no effect without --sft"),
    (["--sft-normalizer", "dllm"], "--sft-normalizer has no effect without --sft"),
    (["--difflm-t-min", "0.9", "--difflm-t-max", "0.5"], "t_min=0.9 and t_max=0.5"),
])
def test_bad_sft_flags_are_one_line(extra, message, capsys):
    assert message in parse_error(TINY + extra, capsys)


def test_sft_data_without_its_answer_pair_is_one_line(tmp_path, capsys):
    prefix = write_corpus(tmp_path / "chat", 4, 20)
    line = parse_error(MODEL + NULL_TOKENIZER + ["--data-path", prefix, "--sft"], capsys)
    assert get_answer_prefix(prefix) in line and "--chat" in line
    builder = IndexedDatasetBuilder(f"{get_answer_prefix(prefix)}.bin", dtype=np.uint8)
    for _ in range(3):  # one document short
        builder.add_document(np.zeros(20, dtype=np.uint8))
    builder.finalize(f"{get_answer_prefix(prefix)}.idx")
    line = parse_error(MODEL + NULL_TOKENIZER + ["--data-path", prefix, "--sft"], capsys)
    assert "different runs" in line


def test_examples_longer_than_a_row_are_counted_in_a_note(tmp_path, capsys):
    from megatron.core.datasets.dataset_builder import DatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    prefix = write_corpus(tmp_path / "chat", 4, 20)
    builder = IndexedDatasetBuilder(f"{get_answer_prefix(prefix)}.bin", dtype=np.uint8)
    for _ in range(4):
        builder.add_document(np.r_[np.zeros(10, dtype=np.uint8), np.ones(10, dtype=np.uint8)])
    builder.finalize(f"{get_answer_prefix(prefix)}.idx")
    sft = SFTDatasetConfig(seq_length=12, eod=EOD)
    train = DatasetBuilder(GPTDatasetConfig(12), sft=sft).from_split([prefix], "1,0,0", [4, 0, 0])[0]
    assert len(train) == 4 and train.truncated == 4
    assert "4 of 4 examples are longer than a row of --seq-length 12" in capsys.readouterr().out
