"""--cache-low-precision-weights (precision/weight_copies.py): the linear layers read bf16
working copies of their fp32 weights in training. A bf16 run trains to the bit as without them,
whichever optimizer writes the copies; a weight changed behind the optimizer's back is copied
again before it is read; evaluation never reads a copy; bad flag combinations are one line."""

import re

import pytest
import torch

from megatron.core.models.difflm import diffusion
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.optimizer.optimizer import OptimizerConfig, build_optimizer
from megatron.core.precision.apply import PrecisionConfig, apply_precision
from tests.unit_tests.test_bad_inputs_training import TINY, parse_error, run_cli
from tests.unit_tests.test_gpt_model import dlm_config, tiny_config, tokens

@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Each test compiles optimizer steps over new parameter lists: clear dynamo's caches after it, so
    that the recompile limit of the shared step function is not spent for the tests after these."""
    yield
    torch._dynamo.reset()


STYLES = {  # Megatron's default configuration, and the Llama style
    "megatron": dict(add_bias_linear=True, normalization="LayerNorm", qk_layernorm=False, gated_linear_unit=False),
    "llama": dict(add_bias_linear=False, normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True),
}


def build(style: str, mode: str = "difflm-noshift", tied: bool = False, masked_only: bool = False) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(tiny_config(bf16=True, share_embeddings_and_output_weights=tied, **STYLES[style]),
                    dlm_config(model_running_mode=mode, masked_only_loss=masked_only,
                               attention_mask_type="causal" if mode == "vanilla" else "no_mask")).train()


def train(style: str, mode: str, copies: bool, compiled: bool, steps: int = 3, fp8_format=None, **shape):
    """Losses, final weights and, with copies, how many copies each step's refresh found stale.
    `fp8_format`: float8 copies; `shape`: `build`'s tied and masked_only."""
    model = build(style, mode, **shape)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1, compiled_step=compiled))
    precision = PrecisionConfig(True, fp8_format)
    weight_copies = apply_precision(model, precision, torch.bfloat16, optimizer) if copies else None
    losses, stale = [], []
    for step in range(steps):
        if weight_copies is not None:
            stale.append(weight_copies.refresh())
        key = diffusion.CorruptionKey.for_batch(7, iteration=step, global_batch_size=2, first_sample_index=2 * step,
                                                batch_size=2) if mode != "vanilla" else None
        loss = model.compute_loss(tokens(seed=step), key=key).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    return losses, weights, stale, weight_copies


@pytest.mark.parametrize("style, mode, compiled", [  # each style in each mode, each optimizer in each
    ("megatron", "difflm-noshift", False), ("megatron", "vanilla", True),
    ("llama", "difflm-noshift", True), ("llama", "vanilla", False)])
def test_a_bf16_run_trains_to_the_bit_as_without_copies(style, mode, compiled):
    losses, weights, stale, copies = train(style, mode, copies=True, compiled=compiled)
    reference_losses, reference_weights, _, _ = train(style, mode, copies=False, compiled=compiled)
    assert losses == reference_losses
    for name, weight in reference_weights.items():
        assert torch.equal(weights[name], weight), name
    linears = len(copies.pairs)
    assert linears == 2 * 4  # qkv, proj, fc1 and fc2 in each of 2 layers, not the untied output layer
    # CompiledAdamW writes the copies in its update, so the refreshes after its steps find none stale;
    # torch's AdamW leaves every one to the refresh (the first refresh has no step before it).
    assert stale == ([linears, 0, 0] if compiled else [linears] * 3)
    for weight, copy in copies.pairs:  # and after the last step every copy is the weight's cast
        copies.refresh()
        assert torch.equal(copy, weight.detach().bfloat16())


@pytest.mark.parametrize("style, mode, tied, compiled", [
    ("megatron", "difflm-noshift", False, False), ("llama", "vanilla", True, True)])
def test_the_masked_only_loss_reads_a_copy_of_the_output_weight(style, mode, tied, compiled):
    """The chunked loss reads the output layer's (or, tied, the word embedding's) copy instead of casting
    the weight: the same bits, so the same training; a copy the loss did not read would change nothing."""
    shape = dict(tied=tied, masked_only=True)
    losses, weights, stale, copies = train(style, mode, copies=True, compiled=compiled, **shape)
    reference_losses, reference_weights, _, _ = train(style, mode, copies=False, compiled=compiled, **shape)
    assert losses == reference_losses
    for name, weight in reference_weights.items():
        assert torch.equal(weights[name], weight), name
    assert len(copies.pairs) == 2 * 4 + 1 and stale[1:] == ([0, 0] if compiled else [9, 9])
    model = build(style, mode, **shape)
    owner = model.output_weight_owner()
    assert owner is (model.embedding.word_embeddings if tied else model.output_layer)
    apply_precision(model, PrecisionConfig(True), torch.bfloat16, build_optimizer(model, OptimizerConfig(lr=1e-2)))
    x, key = tokens(seed=3), (None if mode == "vanilla" else diffusion.CorruptionKey.for_batch(
        7, iteration=0, global_batch_size=2, first_sample_index=0, batch_size=2))
    before = model.compute_loss(x, key=key).loss
    owner.gemm.copy.mul_(0.5)  # the loss reads it ...
    assert not torch.equal(model.compute_loss(x, key=key).loss, before)
    model.eval()  # ... evaluation does not
    with torch.no_grad():
        assert torch.equal(model(x, labels=x)[1], build(style, mode, **shape).eval()(x, labels=x)[1])


def _step(model, optimizer, copies=None) -> None:
    if copies is not None:
        copies.refresh()
    model.compute_loss(tokens(), key=None).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _first_fc1(network):
    return next(module for name, module in network.named_modules() if name.endswith("mlp.linear_fc1"))


def test_a_weight_changed_behind_the_optimizer_is_copied_again_and_eval_never_reads_a_copy():
    """The reference casts (no copies); both models take the same steps and the same edits."""
    model, reference = build("llama", "vanilla"), build("llama", "vanilla")
    optimizer, reference_optimizer = (build_optimizer(m, OptimizerConfig(lr=1e-2, compiled_step=True))
                                      for m in (model, reference))
    copies = apply_precision(model, PrecisionConfig(True), torch.bfloat16, optimizer)
    layer, reference_layer = _first_fc1(model), _first_fc1(reference)
    _step(model, optimizer, copies), _step(reference, reference_optimizer)
    with torch.no_grad():  # an in-place edit after the step wrote the copy: its version moves
        layer.weight.mul_(1.5), reference_layer.weight.mul_(1.5)
    assert copies.refresh() == 1  # only that one: the step wrote the others
    _step(model, optimizer, copies), _step(reference, reference_optimizer)
    with torch.no_grad():  # a new storage with new values, as a loader may assign: caught too
        layer.weight.data = layer.weight.data * 0.5
        reference_layer.weight.data = reference_layer.weight.data * 0.5
    assert copies.refresh() == 1
    x = tokens(seed=5)
    assert torch.equal(model.compute_loss(x, key=None).loss, reference.compute_loss(x, key=None).loss)
    layer.gemm.copy.zero_()  # a copy the training forward reads ...
    assert not torch.equal(model.compute_loss(x, key=None).loss, reference.compute_loss(x, key=None).loss)
    model.eval(), reference.eval()  # ... and evaluation does not
    with torch.no_grad():
        assert torch.equal(model(x, labels=x)[1], reference(x, labels=x)[1])


@pytest.mark.parametrize("flags, message", [
    (["--cache-low-precision-weights"], "--cache-low-precision-weights has no effect without --bf16 or --fp16"),
    (["--bf16", "--cache-low-precision-weights", "--no-gradient-accumulation-fusion"],
     "--cache-low-precision-weights has no effect without gradient-accumulation fusion"),
    (["--bf16", "--cache-low-precision-weights", "--data-parallel-sharding-strategy", "optim_grads_params"],
     "--cache-low-precision-weights does not apply under FSDP2"),
])
def test_flags_it_needs_are_one_line(flags, message, capsys):
    assert message in parse_error(TINY + flags, capsys)


def test_the_command_line_trains_the_same_losses_with_copies():
    """Failing would mean the trainer's copies (attached after the wrapper, refreshed each step) train
    differently from casting: a bf16 CPU run of 3 iterations, its logged losses equal."""
    argv = TINY + ["--bf16", "--train-iters", "3", "--log-interval", "1", "--lr", "1e-2", "--micro-batch-size", "2",
                   "--global-batch-size", "4"]  # the compiled step's writes: test_weight_copies_parallel.py
    runs = [run_cli(*argv, *extra) for extra in ([], ["--cache-low-precision-weights"])]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert "linear layers read working copies of their weights in bfloat16" in runs[1].stdout
    losses = [re.findall(r"lm loss: ([0-9.E+-]+)", run.stdout) for run in runs]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_compiled_layers_read_the_copies_without_a_graph_break():
    """fullgraph=True: a graph break (the buffer lookup, the training flag) would raise."""
    from megatron.core.transformer.compilation import compile_transformer_layers

    results = []
    for copies in (False, True):
        model = build("megatron", "vanilla")
        compile_transformer_layers(model, backend="aot_eager", fullgraph=True)
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
        weight_copies = apply_precision(model, PrecisionConfig(True), torch.bfloat16, optimizer) if copies else None
        losses = []
        for _ in range(2):
            _step(model, optimizer, weight_copies)
            if weight_copies is not None:  # before every training forward, as the trainer does
                weight_copies.refresh()
            losses.append(model.compute_loss(tokens(seed=3), key=None).loss.item())
        results.append(losses)
    assert results[0] == results[1]
