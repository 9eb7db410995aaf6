"""Block diffusion (--difflm-block-diffusion, BD3-LM): the training loss against a re-derivation
from the paper's definition, its reduction to the no_mask objective at one block, per-block t,
the FLOPs count and the flag rules."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.difflm import diffusion, objective
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.training import flops
from tests.unit_tests.test_bad_inputs_training import TINY, parse_error
from tests.unit_tests.test_gpt_model import MASK_ID, build, dlm_config, tiny_config, tokens

L, B = 16, 4


def paper_mask(length: int, block: int, causal_clean: bool = False) -> torch.Tensor:
    """[2L, 2L] visibility over [x_t ; x_0], written out rule by rule from BD3-LM's definition; `causal_clean`:
    the joint AR + DLM objective's clean half, token-causal (a clean token sees the clean tokens up to itself)."""
    allowed = torch.zeros(2 * length, 2 * length, dtype=torch.bool)
    for q in range(2 * length):
        for k in range(2 * length):
            q_noisy, k_noisy = q < length, k < length
            qb, kb = (q % length) // block, (k % length) // block
            if q_noisy and k_noisy:        # (a) block-diagonal inside the noisy half
                allowed[q, k] = qb == kb
            elif q_noisy:                  # (b) a noisy block sees the clean blocks before it
                allowed[q, k] = kb < qb
            elif not k_noisy:              # (c) block-causal inside the clean half (or token-causal)
                allowed[q, k] = (k <= q) if causal_clean else kb <= qb
    return allowed


@pytest.mark.parametrize("t_sampling", ["uniform", "antithetic"])
def test_loss_equals_the_paper_definition(t_sampling):
    dlm = dlm_config(block_diffusion=True, block_size=B, t_sampling=t_sampling)
    model = build(dlm=dlm)
    x0 = tokens(batch=3, seq=L)
    key = objective.CorruptionKey.for_batch(5, iteration=2, global_batch_size=6, first_sample_index=9, batch_size=3,
                                            first_batch_position=3)
    ours = objective.compute_loss(model, x0, key)
    corruption = ours.corruption
    # t per block: one mask probability per block, not per row.
    p = corruption.p_mask.view(3, L // B, B)
    assert torch.equal(p, p[:, :, :1].expand_as(p)) and p[:, :, 0].unique().numel() > 3
    x_in = torch.cat([corruption.noisy_input_ids, x0], dim=1)
    positions = torch.arange(L).repeat(2).expand(3, 2 * L)
    allowed = paper_mask(L, B).expand(3, 2 * L, 2 * L)
    logits = model.inference_forward(x_in, positions, allowed)[:, :L].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x0.reshape(-1), reduction="none").view(3, L)
    masked = corruption.masked_positions
    expected = (ce * masked / corruption.p_mask).sum() / (3 * L)   # 1/p weights, over the B*L noisy tokens
    torch.testing.assert_close(ours.loss, expected, rtol=1e-6, atol=1e-7)


def test_one_block_is_the_no_mask_objective_on_the_same_draws():
    bd3 = build(dlm=dlm_config(block_diffusion=True, block_size=L))
    plain = build(dlm=dlm_config())
    plain.load_state_dict(bd3.state_dict())
    x0 = tokens(batch=2, seq=L)
    noisy, weights, normalizer, _ = objective.loss_inputs(x0, bd3.dlm_config, clamp_normalizer=True)
    per_bd3, loss_bd3 = bd3(noisy, labels=x0, loss_weights=weights, loss_normalizer=normalizer)
    per_plain, loss_plain = plain(noisy, labels=x0, loss_weights=weights, loss_normalizer=normalizer)
    assert per_bd3.shape == (2, L)
    torch.testing.assert_close(loss_bd3, loss_plain, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(per_bd3, per_plain, rtol=1e-6, atol=1e-6)


def test_antithetic_block_t_hits_every_stratum_of_the_grid_once():
    dlm = dlm_config(block_diffusion=True, block_size=B, t_sampling="antithetic")
    key = objective.CorruptionKey.for_batch(1, iteration=7, global_batch_size=5, first_sample_index=0, batch_size=5)
    t = diffusion.sample_block_t(dlm, key, L)
    strata = (t.flatten() * t.numel()).floor().long().sort().values
    assert torch.equal(strata, torch.arange(t.numel()))


def test_clipped_schedule_draws_in_range_and_weights_constant_above_one_half():
    dlm = dlm_config(block_diffusion=True, block_size=B, t_min=0.6, t_max=0.9)
    x0 = tokens(batch=4, seq=L)
    _, weights, _, corruption = objective.loss_inputs(x0, dlm, clamp_normalizer=True)
    p = corruption.p_mask
    assert p.min() >= 0.6 * (1 - dlm.eps) + dlm.eps - 1e-6 and p.max() < 0.9
    assert torch.equal(weights, corruption.masked_positions.float())


def test_ignore_bos_keeps_the_first_token_clean():
    dlm = dlm_config(block_diffusion=True, block_size=B, ignore_bos=True, t_min=0.99)
    x0 = tokens(batch=4, seq=L)
    noisy, weights, _, _ = objective.loss_inputs(x0, dlm, clamp_normalizer=True)
    assert torch.equal(noisy[:, 0], x0[:, 0]) and (weights[:, 0] == 0).all()
    assert (noisy[:, 1:] == MASK_ID).float().mean() > 0.9


def test_flops_count_the_2l_forward_at_the_mask_density():
    config = tiny_config()
    density = paper_mask(L, B).sum().item() / (2 * L)   # keys per query, counted on the dense mask
    assert flops.attention_keys_per_query("block_diffusion", L, B) == density
    terms = flops.forward_flops_breakdown(config, L, "block_causal", B)
    expected = 2 * (sum(terms.values()) - terms["output_layer"]) + terms["output_layer"]
    assert flops.forward_flops_per_token(config, L, "block_diffusion", B) == expected
    dense = AttentionMask("block_diffusion", block_size=B, noisy_length=L).dense(2 * L)[0, 0]
    assert torch.equal(dense, paper_mask(L, B))


@pytest.mark.parametrize("extra, message", [
    (["--difflm-block-diffusion"], "block_size"),
    (["--difflm-block-diffusion", "--difflm-block-size", "5"], "does not divide"),
    (["--difflm-block-diffusion", "--difflm-block-size", "4", "--model-running-mode", "difflm-shift"], "noshift"),
    (["--difflm-block-diffusion", "--difflm-block-size", "4", "--attention-mask-type", "causal"], "no_mask"),
    (["--model-running-mode", "vanilla", "--attention-mask-type", "sliding_window_two_sided", "--sliding-window", "4"],
     "sees later tokens"),
    (["--attention-mask-type", "sliding_window_two_sided"], "needs TransformerConfig.sliding_window"),
])
def test_bad_block_diffusion_flags_are_one_line(extra, message, capsys):
    assert message in parse_error(TINY + extra, capsys)
