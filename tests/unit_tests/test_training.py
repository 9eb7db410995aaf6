"""The training loop in one process: accumulation, NaN skipping, evaluation, flags."""

from functools import partial

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.datasets.mock_dataset import MockGPTDataset
from megatron.core.models.difflm.batch import document_ids_from_eod
from megatron.training.arguments import parse_args
from megatron.training.run_config import parse_run_config
from megatron.training.training import TrainingDiverged, build_trainer


TINY = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
        "--seq-length", "32", "--disable-bias-linear", "--mock-data", "--vocab-size", "60", "--add-mask-token",
        "--lr", "1e-3",
        "--log-interval", "1000", "--eval-iters", "0", "--attention-backend", "math",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def make_trainer(runtime, *extra, forward_step=pretrain_difflm.forward_step, base=TINY):
    """A one-process Trainer of `base` + `extra` flags (other test modules import this and `runtime`)."""
    config = parse_run_config(list(base) + list(extra), add_difflm_args, world_size=1)
    return build_trainer(config, runtime, pretrain_difflm.train_valid_test_datasets_provider,
                         pretrain_difflm.model_provider, forward_step)


def params(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def record_gradients(trainer):
    """Capture every parameter's gradient as the optimizer sees it (after accumulation and scaling)."""
    recorded, step = [], trainer.optimizer.step

    def capturing_step(*args, **kwargs):
        recorded.append({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capturing_step
    return recorded


def assert_same_gradients(grads_a, grads_b):
    for name in grads_a:
        scale = grads_a[name].abs().max().item()
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_gradient_accumulation_equals_one_big_micro_batch(runtime, mode):
    runs = []
    for micro in ("2", "8"):
        trainer = make_trainer(runtime, "--model-running-mode", mode, "--micro-batch-size", micro,
                               "--global-batch-size", "8", "--train-iters", "2")
        grads = record_gradients(trainer)
        trainer.train()
        runs.append((trainer.history, grads))
    (history_a, grads_a), (history_b, grads_b) = runs
    assert trainer.config.num_microbatches == 1
    for step in range(2):
        assert history_a[step].loss == pytest.approx(history_b[step].loss, rel=1e-6)
    # From the same weights the gradients agree to fp32 rounding. After one Adam step they no
    # longer start from identical weights: Adam's first update is lr * sign(g), which flips for
    # elements whose gradient is at rounding level.
    assert_same_gradients(grads_a[0], grads_b[0])


def nan_at(iterations, data_iterator, model, ctx, config):
    output, loss_func = pretrain_difflm.forward_step(data_iterator, model, ctx, config)
    if ctx.iteration in iterations:
        output = output * float("nan")
    return output, loss_func


def test_injected_nan_is_skipped_and_counted(runtime):
    trainer = make_trainer(runtime, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
                           forward_step=partial(nan_at, {1}))
    snapshots = []
    original_step = trainer.train_step

    def recording_step(data_iterator):
        before = params(trainer)
        result = original_step(data_iterator)
        snapshots.append((before, params(trainer), result))
        return result

    trainer.train_step = recording_step
    state = trainer.train()
    assert state.iteration == 4
    assert state.skipped_iterations == 1 and state.nan_iterations == 1
    assert state.consecutive_nan_iterations == 0
    before, after, result = snapshots[1]
    assert result.skipped and result.nan
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed on the skipped step"
    assert all(not s[2].skipped for i, s in enumerate(snapshots) if i != 1)
    assert trainer.scheduler.num_steps == 3, "the LR schedule does not advance on a skipped step"


def test_training_stops_after_too_many_nan_iterations_in_a_row(runtime):
    trainer = make_trainer(runtime, "--train-iters", "10", "--max-consecutive-nan-iterations", "3",
                           forward_step=partial(nan_at, set(range(2, 10))))
    with pytest.raises(TrainingDiverged, match="3 iterations in a row"):
        trainer.train()
    assert trainer.state.iteration == 5


def test_validation_uses_fixed_masks(runtime):
    trainer = make_trainer(runtime, "--train-iters", "2", "--eval-iters", "2", "--micro-batch-size", "2",
                           "--global-batch-size", "4")
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first == second
    trainer.train()
    assert trainer.evaluate() != first, "training changed the model, so the loss must move"


def test_lr_in_the_optimizer_follows_the_schedule(runtime):
    trainer = make_trainer(runtime, "--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
                           "--min-lr", "1e-4")
    trainer.train()
    for group in trainer.optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-4)
    decays = {group["weight_decay"] for group in trainer.optimizer.param_groups}
    assert decays == {0.0, 0.01}, "norms and biases get no weight decay"


def test_mock_data_is_deterministic_and_has_documents():
    dataset = MockGPTDataset(10, 64, text_vocab_size=50, eod=50, seed=3)
    again = MockGPTDataset(10, 64, text_vocab_size=50, eod=50, seed=3)
    assert torch.equal(dataset[4]["tokens"], again[4]["tokens"])
    assert not torch.equal(dataset[4]["tokens"], dataset[5]["tokens"])
    assert dataset[4]["tokens"].shape == (65,)
    assert (dataset[4]["tokens"] == 50).any(), "EOD separates documents"
    documents = document_ids_from_eod(torch.tensor([[1, 2, 9, 3, 9, 4]]), eod=9)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2]]


BAD_INPUTS = [
    (["--micro-batch-size", "3", "--global-batch-size", "8", "--train-iters", "1"], "--global-batch-size 8"),
    (["--train-iters", "1", "--model-running-mode", "difflm-xyz"], "--model-running-mode"),
    (["--train-iters", "1", "--bf16", "--fp16"], "--bf16 and --fp16"),
    (["--train-iters", "1", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    (["--train-iters", "1", "--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
    (["--train-iters", "1", "--attention-mask-type", "block_causal", "--difflm-block-size", "5"], "block_size"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS)
def test_bad_flags_exit_2_with_one_clear_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY + argv, add_difflm_args, world_size=1)
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], error_lines


def test_missing_mask_token_fails_before_any_model_is_built(capsys):
    argv = [a for a in TINY if a != "--add-mask-token"] + ["--train-iters", "1"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_difflm.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "--mask-token" in captured.err
    assert "MegaDLMs:" not in captured.out, "the model must not be built"


def test_flags_build_the_configs():
    args = parse_args(TINY + ["--train-iters", "1", "--qk-layernorm", "--rotary-base", "1e6",
                              "--untie-embeddings-and-output-weights"], add_difflm_args, world_size=1)
    config = args.transformer_config
    assert (config.num_query_groups, config.gated_linear_unit, config.activation) == (2, True, "silu")
    assert config.qk_layernorm and config.rotary_base == 1e6 and not config.share_embeddings_and_output_weights
    assert config.vocab_size == 128, "61 tokens padded to a multiple of 128"
    assert args.dlm_config.mask_token_id == 60 and args.dlm_config.model_running_mode == "difflm-noshift"


def test_exit_interval_and_train_samples(runtime):
    trainer = make_trainer(runtime, "--train-samples", "40", "--global-batch-size", "4", "--micro-batch-size", "4",
                           "--exit-interval", "3")
    assert trainer.config.train_iters == 10
    state = trainer.train()
    assert state.iteration == 3 and state.consumed_train_samples == 12


def test_help_is_grouped():
    from megatron.training.arguments import build_parser

    text = build_parser(add_difflm_args).format_help()
    for group in ("model shape", "training", "learning rate and optimizer", "data and tokenizer",
                  "logging and evaluation", "distributed", "difflm"):
        assert f"{group}:" in text


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_packing_flags_give_documents_positions_and_eod_masking(mode):
    from megatron.training.step_state import StepContext

    config = parse_run_config(TINY + ["--train-iters", "1", "--seq-length", "8", "--model-running-mode", mode,
                                      "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"],
                              add_difflm_args, world_size=1)
    eod = config.data.tokenizer.eod
    tokens = torch.tensor([[5, 6, eod, 7, 8, 9, eod, 10, 11]])
    batch = pretrain_difflm.get_batch(iter([{"tokens": tokens, "index": torch.tensor([0])}]), config,
                                      StepContext(0, 0, 1, 0), torch.device("cpu"))
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    labels = batch["labels"]
    expected_labels = tokens[:, :8] if mode != "vanilla" else tokens[:, 1:]
    assert torch.equal(labels, expected_labels)
    assert torch.equal(batch["loss_mask"], labels != eod)


@pytest.mark.parametrize("argv,message", [
    (["--tensor-model-parallel-size", "3"], "--num-attention-heads 4 is not divisible"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "31"], "--seq-length 31"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
     "--num-layers 2 is not divisible by --pipeline-model-parallel-size 4"),
])
def test_parallel_layout_problems_exit_2_before_any_model(argv, message, capsys):
    world = 1
    for flag, value in zip(argv, argv[1:]):
        if flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
            world *= int(value)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY + ["--train-iters", "1"] + argv, add_difflm_args, world_size=world)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_get_batch_rejects_out_of_range_tokens_on_the_host():
    """The data path owns the id check in training (the model skips its host sync there)."""
    from megatron.training.step_state import StepContext

    config = parse_run_config(TINY + ["--train-iters", "1", "--seq-length", "8"], add_difflm_args, world_size=1)
    assert not pretrain_difflm.model_provider(config).config.check_token_ids
    tokens = torch.tensor([[5, 6, 7, config.data.padded_vocab_size, 8, 9, 10, 11, 12]])
    with pytest.raises(ValueError, match=r"tokens holds values in \[5, 128\].*--vocab-size"):
        pretrain_difflm.get_batch(iter([{"tokens": tokens, "index": torch.tensor([0])}]), config,
                                  StepContext(0, 0, 1, 0), torch.device("cpu"))
