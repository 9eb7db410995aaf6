"""The joint AR + DLM objective (--difflm-ar-loss-weight W): its loss against a hand-computed reference
(the diffusion term on x_t plus W times the next-token term on the causal clean half), the clean half
as an AR model's forward, the weights, the mask on every backend, the training loop's two logged terms
and the refusals (every layout: tests/distributed/test_block_diffusion_parity.py)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.difflm import objective
from megatron.core.transformer.attention_backends import core_attention
from megatron.core.transformer.attention_mask import AttentionMask
from tests.unit_tests.test_bad_inputs_training import TINY as BAD_TINY, parse_error
from tests.unit_tests.test_block_diffusion import paper_mask
from tests.unit_tests.test_gpt_model import MASK_ID, build, dlm_config, tiny_config, tokens
from tests.unit_tests.test_training import assert_same_gradients, make_trainer, record_gradients

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

L, B, W = 16, 4, 0.7


def joint_mask(length: int, block: int) -> torch.Tensor:
    """[2L, 2L] visibility over [x_t ; x_0], rule by rule: BD3-LM's noisy half, a token-causal clean half."""
    return paper_mask(length, block, causal_clean=True)


def reference_losses(model, corruption, x0):
    """(per-token CE of the noisy half [b, L], next-token CE of the clean half [b, L - 1]) from the logits of
    [x_t ; x_0] under `joint_mask`, and those logits."""
    rows = x0.shape[0]
    x_in = torch.cat([corruption.noisy_input_ids, x0], dim=1)
    positions = torch.arange(L).repeat(2).expand(rows, 2 * L)
    logits = model.inference_forward(x_in, positions, joint_mask(L, B).expand(rows, 2 * L, 2 * L)).float()
    vocab = logits.shape[-1]
    noisy_ce = F.cross_entropy(logits[:, :L].reshape(-1, vocab), x0.reshape(-1), reduction="none").view(rows, L)
    next_ce = F.cross_entropy(logits[:, L:2 * L - 1].reshape(-1, vocab), x0[:, 1:].reshape(-1),
                              reduction="none").view(rows, L - 1)
    return noisy_ce, next_ce, logits


def joint_model(**changes):
    return build(dlm=dlm_config(block_diffusion=True, block_size=B, ar_loss_weight=W, **changes))


@pytest.mark.parametrize("masked_only", [False, True], ids=["full_logits", "masked_only"])
def test_the_loss_is_the_diffusion_term_plus_w_times_the_next_token_term(masked_only):
    model = joint_model(masked_only_loss=masked_only)
    x0 = tokens(batch=3, seq=L)
    key = objective.CorruptionKey.for_batch(5, iteration=2, global_batch_size=6, first_sample_index=9, batch_size=3)
    ours = objective.compute_loss(model, x0, key)
    corruption = ours.corruption
    noisy_ce, next_ce, logits = reference_losses(model, corruption, x0)
    diffusion_term = (noisy_ce * corruption.masked_positions / corruption.p_mask).sum() / (3 * L)
    ar_term = W * next_ce.sum() / (3 * L)  # the last clean token has no next token; one normalizer, B * L
    torch.testing.assert_close(ours.terms["ar loss"], ar_term, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.loss, diffusion_term + ar_term, rtol=1e-6, atol=1e-7)
    # The clean half is an AR model's forward: the same logits as a causal forward of x_0 alone.
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(3, L, L)
    ar_logits = model.inference_forward(x0, torch.arange(L).expand(3, L), causal).float()
    torch.testing.assert_close(logits[:, L:], ar_logits, rtol=1e-5, atol=1e-5)


def test_under_the_sequence_normalizer_both_terms_are_means_of_row_means():
    """LLaDA's per-sequence normalization (its SFT recipe): each row's diffusion sum over its maskable
    tokens, each row's next-token sum over its next-token positions, both then averaged over the rows."""
    model = joint_model(loss_normalizer="sequence")
    x0 = tokens(batch=3, seq=L)
    mask = torch.ones(3, L, dtype=torch.bool)
    mask[1, 10:] = False  # a row whose tail carries no loss (padding)
    ours = objective.compute_loss(model, x0, loss_mask=mask)
    corruption = ours.corruption
    noisy_ce, next_ce, _ = reference_losses(model, corruption, x0)
    diffusion_rows, ar_rows = [], []
    for row in range(3):
        maskable = mask[row]
        masked = corruption.masked_positions[row] & maskable
        diffusion_rows.append((noisy_ce[row] * masked / corruption.p_mask[row]).sum() / maskable.sum())
        targets = mask[row, 1:]  # position i predicts token i + 1 where that token may carry a loss
        ar_rows.append(W * (next_ce[row] * targets).sum() / targets.sum())
    torch.testing.assert_close(ours.terms["ar loss"], torch.stack(ar_rows).mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.loss, torch.stack(diffusion_rows).mean() + torch.stack(ar_rows).mean(),
                               rtol=1e-6, atol=1e-7)


def test_ar_weights_follow_the_loss_mask_of_the_next_token():
    dlm = dlm_config(block_diffusion=True, block_size=B, ar_loss_weight=2.0)
    mask = torch.tensor([[True, True, False, True, True], [False, True, True, True, False]])
    weights = objective.joint_ar_weights(torch.zeros(2, 5, dtype=torch.long), dlm, mask)
    # position i carries 2.0 where token i + 1 may have a loss; the last position has no next token
    assert weights.tolist() == [[2.0, 0.0, 2.0, 2.0, 0.0], [2.0, 2.0, 2.0, 0.0, 0.0]]
    assert objective.joint_ar_weights(torch.zeros(2, 5, dtype=torch.long), dlm_config(), mask) is None


def test_the_mask_on_flex_equals_the_dense_rule_and_plain_block_diffusion_differs():
    mask = AttentionMask("block_diffusion", block_size=B, noisy_length=L, causal_clean=True)
    assert torch.equal(mask.dense(2 * L)[0, 0], joint_mask(L, B))
    plain = AttentionMask("block_diffusion", block_size=B, noisy_length=L)
    assert plain != mask and not torch.equal(plain.dense(2 * L), mask.dense(2 * L))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 2 * L, 8, generator=generator) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(core_attention(q, k, v, mask, backend="flex"),
                                   core_attention(q, k, v, mask, backend="math"), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_the_mask_on_cuda_kernels_matches_math_with_gradients(backend):
    mask = AttentionMask("block_diffusion", block_size=B, noisy_length=64, causal_clean=True)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 128, 16, generator=generator).cuda() for _ in range(4))

    def run(name):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = core_attention(*leaves, mask, backend=name)
        return out.detach(), torch.autograd.grad((out * grad).sum(), leaves)

    (out, grads), (ref, ref_grads) = run(backend), run("math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


JOINT = ["--difflm-block-diffusion", "--difflm-block-size", "8", "--difflm-ar-loss-weight", str(W)]


def test_training_logs_both_terms_and_accumulation_equals_one_big_batch(runtime):
    runs = []
    for micro in ("2", "8"):
        trainer = make_trainer(runtime, *JOINT, "--micro-batch-size", micro, "--global-batch-size", "8",
                               "--train-iters", "2", "--eod-mask-loss")
        grads = record_gradients(trainer)
        trainer.train()
        runs.append((trainer.history, grads))
    (history_a, grads_a), (history_b, grads_b) = runs
    for step in range(2):
        parts = history_a[step].parts
        assert set(parts) == {"diffusion loss", "ar loss"} and parts["ar loss"] > 0
        assert parts["diffusion loss"] + parts["ar loss"] == pytest.approx(history_a[step].loss, rel=1e-6)
        for name in parts:
            assert history_b[step].parts[name] == pytest.approx(parts[name], rel=1e-6)
    assert_same_gradients(grads_a[0], grads_b[0])


@pytest.mark.parametrize("extra, message", [
    (["--difflm-ar-loss-weight", "0.5"], "rides on block diffusion"),
    (JOINT + ["--difflm-loss-normalizer", "masked"], "use loss_normalizer 'tokens' or 'sequence'"),
    (["--difflm-block-diffusion", "--difflm-block-size", "8", "--difflm-ar-loss-weight", "-1"], ">= 0"),
])
def test_bad_joint_flags_are_one_line(extra, message, capsys):
    assert message in parse_error(BAD_TINY + extra, capsys)


def joint_sampler_model():
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
    from tests.unit_tests.test_generation import MASK_ID as SAMPLER_MASK, VOCAB

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, vocab_size=VOCAB, max_position_embeddings=64, qk_layernorm=True,
                               attention_backend="math", init_method_std=0.5)
    torch.manual_seed(0)
    return GPTModel(config, DLMConfig(model_running_mode="difflm-noshift", block_diffusion=True, block_size=B,
                                      mask_token_id=SAMPLER_MASK, ar_loss_weight=1.0)).eval()


def test_the_sampler_denoises_a_block_from_what_training_shows_it_and_its_cache_is_exact():
    from megatron.core.inference.generation import canvas_layout
    from megatron.core.inference.generation_options import resolve_options
    from tests.unit_tests.test_generation import EOS_ID, MASK_ID as SAMPLER_MASK, prompts

    model, length, k = joint_sampler_model(), 12, 2
    clean = torch.randint(0, EOS_ID, (1, length), generator=torch.Generator().manual_seed(3))
    noisy = clean.clone()
    noisy[0, k * B + 1:] = SAMPLER_MASK                 # blocks < k committed, block k half denoised
    opts = resolve_options("difflm-noshift", gen_length=length, **model.trained_pattern())
    view = noisy[:, :(k + 1) * B]
    layout = canvas_layout(torch.ones(1, 0, dtype=torch.bool), length, opts)
    sampled = model.inference_forward(view, layout.positions[:, :view.shape[1]],
                                      layout.attention_mask(0, view.shape[1], view.shape[1]))[:, k * B:]
    x_t = torch.full_like(clean, SAMPLER_MASK)
    x_t[0, :(k + 1) * B] = view[0]
    both = torch.cat([x_t, clean], dim=1)
    trained = model.inference_forward(both, torch.arange(length).repeat(2)[None],
                                      joint_mask(length, B)[None])[:, k * B:(k + 1) * B]
    torch.testing.assert_close(sampled, trained, rtol=1e-5, atol=1e-5)
    prompt = torch.stack(prompts([6, 6]))
    expected = model.generate(prompt, gen_length=13)
    for cache in ("prefix", "dual"):  # committed blocks enter the cache token-causally, as computed without it
        assert torch.equal(model.generate(prompt, gen_length=13, cache=cache), expected), cache


def test_a_joint_model_also_decodes_autoregressively():
    from tests.unit_tests.test_generation import prompts

    model = joint_sampler_model()
    prompt = torch.stack(prompts([5]))
    decoded = model.generate(prompt, gen_length=6, autoregressive=True)
    sequence = prompt.clone()
    for _ in range(6):  # greedy next-token decoding with causal attention, written out
        n = sequence.shape[1]
        logits = model.inference_forward(sequence, torch.arange(n)[None], torch.ones(n, n).tril().bool()[None])
        sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(decoded, sequence)
    plain = build(dlm=dlm_config(block_diffusion=True, block_size=B))
    with pytest.raises(ValueError, match="learned no next-token prediction"):
        plain.generate(prompt, gen_length=2, autoregressive=True)


def test_use_checkpoint_args_keeps_a_joint_checkpoints_causal_clean_half(tmp_path):
    """--use-checkpoint-args takes a joint checkpoint's next-token weight with its block diffusion, so the
    run attends its clean half causally as trained (a plain run loading it is refused:
    test_checkpoint_compatibility.py)."""
    import json

    from custom_args.difflm import add_difflm_args
    from megatron.training.arguments import parse_args
    from tools.weights_conversion import checkpoint_io

    target = tmp_path / "ckpt" / "iter_0000003"  # what --use-checkpoint-args reads: the metadata
    target.mkdir(parents=True)
    dlm = dlm_config(block_diffusion=True, block_size=B, ar_loss_weight=W, mask_token_id=MASK_ID)
    metadata = checkpoint_io.metadata_for(tiny_config(), dlm, 1, None, 32, {}, iteration=3)
    (target / "metadata.json").write_text(json.dumps(metadata))
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    args = parse_args(BAD_TINY + ["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--finetune"],
                      add_difflm_args, world_size=1)
    assert args.dlm_config.block_diffusion and args.dlm_config.ar_loss_weight == W
    assert args.dlm_config.causal_clean_half


def test_the_flops_count_the_causal_clean_half():
    """The joint mask's keys per query: its dense density, less the quarter key Megatron's s/2 convention
    for causal attention leaves out (the clean half's exact mean is (s + 1) / 2); the step counts it."""
    from megatron.training import flops

    density = joint_mask(L, B).sum().item() / (2 * L)
    assert flops.attention_keys_per_query(flops.JOINT_BLOCK_DIFFUSION, L, B) == density - 0.25
    assert flops.attention_keys_per_query(flops.JOINT_BLOCK_DIFFUSION, L, B) < flops.attention_keys_per_query(
        "block_diffusion", L, B)
    config = tiny_config()
    joint = dlm_config(block_diffusion=True, block_size=B, ar_loss_weight=W)
    expected = flops.training_flops_per_iteration(config, L, 2, mask_type=flops.JOINT_BLOCK_DIFFUSION, block_size=B,
                                                  output_positions=2 * L - 1)
    assert flops.executed_flops_per_iteration(config, joint, L, 2) == expected
