"""DLMConfig.masked_only_loss: the chunked output layer + cross-entropy at the positions with a
nonzero loss weight gives the full-logit path's loss and gradients (fp32, CPU)."""

import dataclasses

import pytest
import torch

from megatron.core.models.difflm import diffusion
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

VOCAB = 60
MASK_ID = 59


def build(mode: str, tied: bool, padded: bool, masked_only: bool, compile_loss: bool = False) -> GPTModel:
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, vocab_size=64 if padded else VOCAB,
                               unpadded_vocab_size=VOCAB if padded else None, max_position_embeddings=64,
                               qk_layernorm=True, attention_backend="math",
                               share_embeddings_and_output_weights=tied)
    # A chunk of 7 tokens: several chunks and an uneven split for ~20 selected positions.
    dlm = DLMConfig(model_running_mode=mode, mask_token_id=MASK_ID, masked_only_loss=masked_only,
                    loss_chunk_size=7, compile_loss=compile_loss)
    torch.manual_seed(0)
    return GPTModel(config, dlm).train()


def ids(batch=3, seq=16, seed=1) -> torch.Tensor:
    return torch.randint(0, MASK_ID, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: GPTModel, tokens: torch.Tensor, per_token_backward: bool = False):
    key = diffusion.CorruptionKey.for_batch(1234, iteration=2, global_batch_size=3, first_sample_index=6,
                                            batch_size=3)
    loss_mask = torch.ones_like(tokens, dtype=torch.bool)
    loss_mask[2, 11:] = False  # padding at the end of a row
    out = model.compute_loss(tokens, key=key if model.dlm_config.is_diffusion else None, loss_mask=loss_mask)
    if per_token_backward:  # a caller that weights the per-token losses itself
        weights = out.corruption.masked_positions.float() / out.corruption.p_mask if out.corruption else loss_mask
        (out.per_token_loss * weights).sum().backward()
    else:
        out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_close(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for name, grad in expected.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(actual[name], grad, rtol=1e-6, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift", "vanilla"])
def test_same_loss_and_gradients_as_the_full_logits(mode, tied, padded):
    tokens = ids()
    full_out, full_grads = loss_and_grads(build(mode, tied, padded, masked_only=False), tokens)
    out, grads = loss_and_grads(build(mode, tied, padded, masked_only=True), tokens)
    torch.testing.assert_close(out.loss, full_out.loss, rtol=1e-6, atol=0)
    assert_grads_close(grads, full_grads)
    # Per-token losses agree where the loss looks; elsewhere the masked-only path computes nothing.
    selected = torch.zeros_like(tokens, dtype=torch.bool)
    if out.corruption is not None:
        selected = out.corruption.masked_positions
        assert 0 < selected.sum() < selected.numel()
    else:
        selected[:, :-1] = True
        selected[2, 11:] = False
    torch.testing.assert_close(out.per_token_loss[selected], full_out.per_token_loss[selected], rtol=1e-6, atol=1e-6)
    assert torch.all(out.per_token_loss[~selected] == 0)


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_a_tied_weight_gets_one_gradient_completed_by_the_embedding(mode, monkeypatch):
    """Tied, the chunked loss hands the output layer's gradient to the embedding's backward, which adds
    its rows in place (tensor_parallel/tied_gradient.py): the same gradients as autograd's sum of the
    two. The full-logits path returns its gradient as usual and the embedding's backward finds none."""
    from megatron.core.tensor_parallel import tied_gradient

    handed = []
    take = tied_gradient.TiedGradient.take
    monkeypatch.setattr(tied_gradient.TiedGradient, "take", lambda self: handed.append(self.grad is not None)
                        or take(self))
    tokens = ids()
    _, full_grads = loss_and_grads(build(mode, True, True, masked_only=False), tokens)
    _, grads = loss_and_grads(build(mode, True, True, masked_only=True), tokens)
    assert handed == [False, True]
    assert_grads_close(grads, full_grads)


def test_the_tied_embedding_adds_repeated_rows_into_the_handed_gradient():
    from megatron.core.tensor_parallel.tied_gradient import TiedGradient, embedding

    weight = torch.randn(5, 3, requires_grad=True)
    ids, upstream = torch.tensor([[1, 3, 1], [4, 1, 0]]), torch.randn(2, 3, 3)
    nn_grad, = torch.autograd.grad((torch.nn.functional.embedding(ids, weight) * upstream).sum(), weight)
    tied, handed = TiedGradient(), torch.randn(5, 3)
    out = embedding(ids, weight, tied)
    assert tied.armed
    tied.grad = handed.clone()  # what the loss's backward leaves there
    grad, = torch.autograd.grad((out * upstream).sum(), weight)
    torch.testing.assert_close(grad, handed + nn_grad, rtol=1e-6, atol=1e-6)
    assert tied.grad is None
    with torch.no_grad():  # no autograd: a plain lookup, nothing armed
        fresh = TiedGradient()
        assert torch.equal(embedding(ids, weight, fresh), weight[ids]) and not fresh.armed


@pytest.mark.gpu  # index_add_'s atomics and its deterministic path are CUDA's
def test_the_tied_rows_repeat_to_the_bit_under_deterministic_mode():
    """--deterministic-mode (torch.use_deterministic_algorithms) makes the rows' in-place sum repeatable
    even where many ids repeat (index_add_'s atomics would not be); the sum is the dense one's."""
    from megatron.core.tensor_parallel.tied_gradient import add_rows

    generator = torch.Generator().manual_seed(0)
    handed = torch.randn(1000, 64, generator=generator).cuda()
    ids = torch.randint(0, 1000, (4, 512), generator=generator).cuda()
    ids[:, :256] = 7
    upstream = torch.randn(4, 512, 64, generator=generator).cuda()
    dense = torch.ops.aten.embedding_dense_backward(upstream.reshape(-1, 64), ids.reshape(-1), 1000, -1, False)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        sums = [handed.clone() for _ in range(2)]
        for grad in sums:
            add_rows(grad, ids, upstream)
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(sums[0], sums[1])
    torch.testing.assert_close(sums[0], handed + dense, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift"])
def test_gradients_through_the_per_token_losses(mode):
    tokens = ids()
    _, full_grads = loss_and_grads(build(mode, True, True, masked_only=False), tokens, per_token_backward=True)
    _, grads = loss_and_grads(build(mode, True, True, masked_only=True), tokens, per_token_backward=True)
    assert_grads_close(grads, full_grads)


def test_no_selected_position_gives_zero_loss_and_zero_gradients():
    model = build("difflm-noshift", True, False, masked_only=True)
    tokens = ids()
    per_token, loss = model(tokens, labels=tokens, loss_weights=torch.zeros(tokens.shape))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(per_token == 0)
    assert all(torch.all(p.grad == 0) for p in model.parameters() if p.grad is not None)


def test_eval_without_grad_matches():
    tokens = ids()
    results = []
    for masked_only in (False, True):
        model = build("difflm-noshift", False, True, masked_only).eval()
        key = diffusion.CorruptionKey.for_batch(1234, iteration=0, global_batch_size=3, first_sample_index=0,
                                                batch_size=3)
        with torch.no_grad():
            results.append(model.compute_loss(tokens, key=key).loss)
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("factor", [1.0, 0.5, 3.0])
def test_the_gradients_are_scaled_by_the_loss_sums_gradient(factor, monkeypatch):
    """The gradients made in forward are scaled by the loss sum's incoming gradient: left as they are
    for the training loop's 1 (the [V, h] pass skipped on the device), fp16's loss scale or any other
    factor scales both."""
    from megatron.core.fusions import fused_cross_entropy

    factors, original = [], fused_cross_entropy.scale_unless_one_
    monkeypatch.setattr(fused_cross_entropy, "scale_unless_one_",
                        lambda tensor, f: factors.append(float(f)) or original(tensor, f))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 8, generator=generator, requires_grad=True)
    weight = torch.randn(20, 8, generator=generator, requires_grad=True)
    targets, weights = torch.randint(0, 20, (30,), generator=generator), torch.rand(30, generator=generator)
    _, loss_sum = linear_cross_entropy(hidden, weight, targets, weights, chunk_size=7)
    (loss_sum * factor).backward()
    expected = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="none")
    reference = torch.autograd.grad((expected * weights).sum() * factor, (hidden, weight))
    assert factors == [factor, factor]  # the hidden and the weight gradient
    for actual, want in zip((hidden.grad, weight.grad), reference):
        torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_rejects_a_second_backward():
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    _, loss_sum = linear_cross_entropy(hidden, weight, torch.arange(5), torch.ones(5), chunk_size=2)
    loss_sum.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss_sum.backward()


def test_chunk_size_is_validated():
    with pytest.raises(ValueError, match="loss_chunk_size"):
        dataclasses.replace(DLMConfig(mask_token_id=1), loss_chunk_size=0).validate(vocab_size=8)


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift"])
def test_compiled_loss_kernel_matches_the_full_logits(mode):
    """--difflm-compile-loss: the chunk's softmax and gradient as one compiled function (several
    chunk sizes in one run: the compiled function must take new shapes without recompiling)."""
    tokens = ids()
    full_out, full_grads = loss_and_grads(build(mode, True, True, masked_only=False), tokens)
    out, grads = loss_and_grads(build(mode, True, True, masked_only=True, compile_loss=True), tokens)
    from megatron.core.tensor_parallel import linear_cross_entropy as module

    assert module.compiled_softmax_loss_gradient.cache_info().currsize == 1, "the compiled kernel ran"
    torch.testing.assert_close(out.loss, full_out.loss, rtol=1e-6, atol=0)
    assert_grads_close(grads, full_grads)
    selected = out.corruption.masked_positions
    torch.testing.assert_close(out.per_token_loss[selected], full_out.per_token_loss[selected], rtol=1e-6, atol=1e-6)


def test_compiled_loss_needs_the_masked_only_loss():
    with pytest.raises(ValueError, match="compile_loss needs masked_only_loss"):
        DLMConfig(mask_token_id=MASK_ID, compile_loss=True).validate(VOCAB)


@pytest.mark.gpu  # the fp32-output GEMMs (out_dtype) run on CUDA only
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_bf16_chunks_accumulate_fp32_gradients_on_cuda(compiled, per_token):
    """bf16 matmuls writing and accumulating fp32 gradients over 3 chunks (and through the
    per-token path) equal an fp64 cross-entropy of the same bf16 inputs to bf16 logit rounding."""
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(300, 64, generator=generator) * 0.5).cuda().requires_grad_()
    weight = (torch.randn(1000, 64, generator=generator) * 0.5).cuda().requires_grad_()
    targets = torch.randint(0, 990, (300,), generator=generator).cuda()
    weights = torch.rand(300, generator=generator).cuda()
    losses, loss_sum = linear_cross_entropy(hidden, weight, targets, weights, unpadded_vocab_size=990,
                                            compute_dtype=torch.bfloat16, chunk_size=100, compiled=compiled)
    (losses * weights).sum().backward() if per_token else (loss_sum * 0.5).backward()
    h64, w64 = (t.detach().bfloat16().double().requires_grad_() for t in (hidden, weight))
    expected = torch.nn.functional.cross_entropy(h64 @ w64[:990].t(), targets, reduction="none")
    ((expected * weights.double()).sum() * (1.0 if per_token else 0.5)).backward()
    torch.testing.assert_close(losses.double(), expected.detach(), rtol=2e-2, atol=2e-2)
    for actual, reference in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        error = (actual.double() - reference).norm() / reference.norm()
        assert error < 2e-2, error.item()


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_the_selection_and_its_host_sync_come_before_the_decoder(mode, monkeypatch):
    """Failing would put the masked-only loss's sync (the selected count) back after the decoder,
    where the GPU idles through the loss's host work (OutputLayer.loss_targets)."""
    model, events = build(mode, tied=True, padded=False, masked_only=True), []
    model.embedding.register_forward_pre_hook(lambda *_: events.append("embedding"))
    model.decoder.register_forward_pre_hook(lambda *_: events.append("decoder"))
    original = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **k: events.append("nonzero") or
                        original(self, *a, **k))
    out, _ = loss_and_grads(model, ids())
    assert "nonzero" in events and events.index("nonzero") < events.index("embedding") < events.index("decoder")
    monkeypatch.undo()
    reference, _ = loss_and_grads(build(mode, tied=True, padded=False, masked_only=False), ids())
    torch.testing.assert_close(out.loss, reference.loss, rtol=1e-6, atol=0)
