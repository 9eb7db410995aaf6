"""GPTModel: masks seen end to end, losses per mode, recompute, pipeline slices, overfitting."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.difflm import diffusion
from megatron.core.models.difflm.batch import positions_from_documents
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

VOCAB = 64
MASK_ID = 63


def tiny_config(**changes) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                vocab_size=VOCAB, max_position_embeddings=64, qk_layernorm=True, attention_backend="math")
    base.update(changes)
    return TransformerConfig(**base)


def dlm_config(**changes) -> DLMConfig:
    base = dict(model_running_mode="difflm-noshift", attention_mask_type="no_mask", mask_token_id=MASK_ID)
    base.update(changes)
    return DLMConfig(**base)


def build(seed=0, config=None, dlm=None) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config or tiny_config(), dlm or dlm_config()).eval()


def tokens(batch=2, seq=16, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (batch, seq), generator=torch.Generator().manual_seed(seed))


def visibility(mask_type: str, seq: int, block=4, window=3, documents=None) -> torch.Tensor:
    """One layer's [s, s] visibility, written independently of the library."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = {
        "no_mask": torch.ones(seq, seq, dtype=torch.bool),
        "causal": j <= i,
        "block_causal": (j // block) <= (i // block),
        "sliding_window": (i - j >= 0) & (i - j < window),
        "sliding_window_two_sided": (i - j < window) & (j - i < window),
    }[mask_type]
    if documents is not None:
        allowed = allowed & (documents[:, None] == documents[None, :])
    return allowed


def reach(one_layer: torch.Tensor, layers: int) -> torch.Tensor:
    """Which inputs can influence which outputs after `layers` attention layers."""
    result = one_layer.clone()
    for _ in range(layers - 1):
        result = (result.float() @ one_layer.float()) > 0
    return result


MASK_CASES = [("difflm-noshift", "no_mask"), ("difflm-noshift", "causal"), ("difflm-noshift", "block_causal"),
              ("difflm-noshift", "sliding_window"), ("difflm-noshift", "sliding_window_two_sided"),
              ("vanilla", "no_mask")]


@pytest.mark.parametrize("mode,mask_type", MASK_CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_perturbing_a_token_changes_exactly_the_outputs_allowed_to_see_it(mode, mask_type, packed):
    seq = 12
    config = tiny_config(sliding_window=3)
    model = build(config=config, dlm=dlm_config(model_running_mode=mode, attention_mask_type=mask_type,
                                                 block_size=4))
    documents = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3]) if packed else None
    base = tokens(1, seq)
    effective = "causal" if mode == "vanilla" else mask_type
    expected = reach(visibility(effective, seq, documents=None if documents is None else documents[0]),
                     config.num_layers)
    with torch.no_grad():
        reference = model(base, document_ids=documents)
        for j in range(seq):
            changed = base.clone()
            changed[0, j] = (changed[0, j] + 7) % (VOCAB - 1)
            delta = (model(changed, document_ids=documents) - reference).abs().amax(-1)[0]
            moved = delta > 1e-6
            assert torch.equal(moved, expected[:, j]), f"token {j}: outputs moved {moved.tolist()}"


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "block_causal", "sliding_window"])
def test_backends_agree_with_math_inside_the_model(backend, mask_type):
    documents = torch.tensor([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5])
    dlm = dlm_config(attention_mask_type=mask_type, block_size=4)
    reference = build(config=tiny_config(sliding_window=5), dlm=dlm)
    other = build(config=tiny_config(sliding_window=5, attention_backend=backend), dlm=dlm)
    other.load_state_dict(reference.state_dict())
    ids = tokens(2, 16)
    for docs in (None, documents):
        with torch.no_grad():  # flex has no CPU backward; its gradients are checked on GPU
            ref_logits, logits = reference(ids, document_ids=docs), other(ids, document_ids=docs)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_packed_documents_equal_separate_sequences():
    """Bidirectional attention per document + RoPE restarting at 0 = running each document alone."""
    model = build()
    first, second = tokens(1, 7, seed=3), tokens(1, 9, seed=4)
    packed = torch.cat([first, second], dim=1)
    documents = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        packed_logits = model(packed, document_ids=documents)
        torch.testing.assert_close(packed_logits[:, :7], model(first), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed_logits[:, 7:], model(second), atol=1e-5, rtol=1e-5)


def test_positions_restart_at_each_document():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert torch.equal(positions_from_documents(documents), expected)


def expected_dlm_loss(model, ids, key, cfg, maskable=None):
    """The loss recomputed from the model's logits with the formulas written out here."""
    corruption = diffusion.corrupt(ids, cfg, key, maskable)
    with torch.no_grad():
        logits = model(corruption.noisy_input_ids)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1), reduction="none").view(ids.shape)
    masked = corruption.masked_positions.float()
    valid = torch.ones_like(masked) if maskable is None else maskable.float()
    t = diffusion.sample_t(cfg, key, ids.device).double()
    p = ((1 - cfg.eps) * t + cfg.eps)[:, None].expand_as(masked)
    weight = {"inverse_p": 1.0 / p,
              "inverse_empirical": (valid.sum(1, keepdim=True)
                                    / masked.sum(1, keepdim=True).clamp(min=1)).expand_as(masked),
              "none": torch.ones_like(masked)}[cfg.loss_weight] * masked
    total = (ce * weight)
    if cfg.loss_normalizer == "tokens":
        return (total.sum() / valid.sum()).float()
    if cfg.loss_normalizer == "masked":
        return (total.sum() / masked.sum().clamp(min=1)).float()
    return (total.sum(1) / valid.sum(1)).mean().float()


@pytest.mark.parametrize("weight", ["inverse_p", "inverse_empirical", "none"])
@pytest.mark.parametrize("normalizer", ["tokens", "masked", "sequence"])
def test_model_loss_matches_hand_formula_for_every_weight_and_normalizer(weight, normalizer):
    cfg = dlm_config(loss_weight=weight, loss_normalizer=normalizer, eps=1e-3)
    model = build(dlm=cfg)
    ids = tokens(4, 16)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[1, 12:] = False  # padding at the end of row 1
    maskable[2, :3] = False  # a prompt at the start of row 2
    key = diffusion.CorruptionKey.for_batch(cfg.seed, iteration=3, global_batch_size=4, first_sample_index=12,
                                            batch_size=4)
    with torch.no_grad():
        out = model.compute_loss(ids, key, loss_mask=maskable)
    expected = expected_dlm_loss(model, ids, key, cfg, maskable)
    torch.testing.assert_close(out.loss, expected, atol=1e-6, rtol=1e-6)
    assert not out.corruption.masked_positions[~maskable].any()


def test_llada_setting_is_ce_over_p_divided_by_batch_times_length():
    cfg = dlm_config(loss_weight="inverse_p", loss_normalizer="tokens", eps=1e-3)
    model = build(dlm=cfg)
    ids = tokens(3, 16)
    key = diffusion.CorruptionKey.for_batch(cfg.seed, iteration=0, global_batch_size=3, first_sample_index=0,
                                            batch_size=3)
    out = model.compute_loss(ids, key)
    masked = out.corruption.masked_positions
    assert masked.any()
    p = out.corruption.p_mask
    expected = (out.per_token_loss * masked / p).sum() / (3 * 16)
    torch.testing.assert_close(out.loss, expected, atol=1e-6, rtol=1e-6)


def test_shift_mode_predicts_the_next_position():
    cfg = dlm_config(model_running_mode="difflm-shift")
    model = build(dlm=cfg)
    ids = tokens(2, 16)
    out = model.compute_loss(ids)
    assert not out.corruption.masked_positions[:, 0].any(), "nothing predicts position 0"
    with torch.no_grad():
        logits = model(out.corruption.noisy_input_ids)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none").view(2, 15)
    torch.testing.assert_close(out.per_token_loss[:, 1:], ce, atol=1e-6, rtol=1e-6)
    assert torch.all(out.per_token_loss[:, 0] == 0)


def test_vanilla_loss_is_next_token_cross_entropy():
    model = build(dlm=DLMConfig(model_running_mode="vanilla"))
    ids = tokens(2, 16)
    out = model.compute_loss(ids)
    with torch.no_grad():
        logits = model(ids)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="selective"),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=2),
                                       dict(recompute_granularity="full", recompute_method="block",
                                            recompute_num_layers=1)])
def test_recompute_gives_identical_loss_and_gradients(recompute):
    config = tiny_config(num_layers=3, hidden_dropout=0.1, attention_dropout=0.1)
    base = build(config=config).train()
    recomputed = build(config=config.replace(**recompute)).train()
    recomputed.load_state_dict(base.state_dict())
    ids = tokens(2, 16)
    losses, grads = [], []
    for model in (base, recomputed):
        torch.manual_seed(5)  # the same dropout draws; recompute must replay them
        out = model.compute_loss(ids)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=0, rtol=0, msg=name)


def test_pipeline_slices_compose_to_the_full_model():
    config = tiny_config(num_layers=4, share_embeddings_and_output_weights=False)
    full = build(config=config)
    first = GPTModel(config, dlm_config(), pre_process=True, post_process=False, layer_range=(0, 2)).eval()
    last = GPTModel(config, dlm_config(), pre_process=False, post_process=True, layer_range=(2, 4)).eval()
    state = full.state_dict()
    for stage in (first, last):
        own = stage.state_dict()
        assert set(own) <= set(state), "stage keys must be the full model's keys (global layer index)"
        stage.load_state_dict({k: state[k] for k in own})
    assert any(k.startswith("decoder.layers.3.") for k in last.state_dict())
    ids = tokens(2, 16)
    with torch.no_grad():
        hidden = first(ids)
        torch.testing.assert_close(last(None, decoder_input=hidden), full(ids), atol=1e-6, rtol=1e-6)


def test_tied_embedding_split_over_stages_is_tagged_for_the_gradient_sum():
    """Tied embeddings over pipeline stages: the last stage's output weight is a replica of the first
    stage's word embedding; both are summed over the embedding group, the copy counted once by the norm."""
    config = tiny_config(num_layers=4)
    first = GPTModel(config, dlm_config(), pre_process=True, post_process=False, layer_range=(0, 2))
    last = GPTModel(config, dlm_config(), pre_process=False, post_process=True, layer_range=(2, 4))
    first_weight, last_weight = first.embedding.word_embeddings.weight, last.embedding.word_embeddings.weight
    assert last.output_weight_owner().weight is last_weight
    torch.testing.assert_close(last_weight, first_weight, atol=0, rtol=0)
    assert first_weight.tied_across_stages and not first_weight.tied_embedding_copy
    assert last_weight.tied_across_stages and last_weight.tied_embedding_copy
    untied = GPTModel(tiny_config(num_layers=4, share_embeddings_and_output_weights=False), dlm_config(),
                      pre_process=True, post_process=False, layer_range=(0, 2))
    for alone in (build().embedding, untied.embedding):  # nothing to sum over stages
        assert not hasattr(alone.word_embeddings.weight, "tied_across_stages")


def test_sharded_state_dict_covers_the_state_dict():
    model = build()
    sharded = model.sharded_state_dict()
    assert set(sharded) == set(model.state_dict())
    state = model.state_dict()
    for key, shard in sharded.items():
        # Fused weights are described in their logical layout, e.g. QKV as (groups, rows, hidden).
        assert torch.equal(shard.data.reshape(state[key].shape), state[key])
        assert torch.Size(shard.global_shape).numel() == state[key].numel()
    assert sharded["decoder.layers.0.mlp.linear_fc1.weight"].global_shape == (2, 48, 32)


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_tiny_model_overfits_one_batch(mode):
    cfg = dlm_config(model_running_mode=mode)
    model = build(config=tiny_config(hidden_size=64, ffn_hidden_size=128), dlm=cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    ids = tokens(4, 16)
    key = diffusion.CorruptionKey.for_batch(cfg.seed, iteration=0, global_batch_size=4, first_sample_index=0,
                                            batch_size=4)
    losses = []
    for _ in range(120):
        optimizer.zero_grad()
        out = model.compute_loss(ids, key)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.1 * losses[0], f"{mode}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_token_ids_outside_the_vocabulary_are_rejected_clearly():
    model = build()
    bad = tokens(1, 8)
    bad[0, 3] = VOCAB + 5
    with pytest.raises(ValueError, match="input_ids.*outside"):
        model(bad)
    with pytest.raises(ValueError, match="labels.*outside"):
        model(tokens(1, 8), labels=torch.full((1, 8), -3))
    with pytest.raises(ValueError, match="max-position-embeddings"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("check_token_ids", [True, False])
def test_bad_labels_fail_before_the_decoder_runs(check_token_ids, monkeypatch):
    """One check of every id up front (without check_token_ids a device-side assert, exact on CPU)."""
    model = build(config=tiny_config(check_token_ids=check_token_ids))

    def decoder_must_not_run(*args, **kwargs):
        raise AssertionError("the decoder ran before the labels were checked")

    monkeypatch.setattr(model.decoder, "forward", decoder_must_not_run)
    with pytest.raises(ValueError, match="labels.*outside.*--vocab-size"):
        model(tokens(1, 8), labels=torch.full((1, 8), VOCAB))
    with pytest.raises(ValueError, match="position_ids.*max-position-embeddings"):
        model.compute_loss(tokens(1, 8), position_ids=torch.full((1, 8), 64))


@pytest.mark.parametrize("changes,field", [
    (dict(num_attention_heads=4, num_query_groups=3), "num_query_groups"),
    (dict(normalization="BatchNorm"), "normalization"),
    (dict(bf16=True, fp16=True), "bf16"),
    (dict(attention_backend="cuda"), "attention_backend"),
    (dict(rotary_percent=1.5), "rotary_percent"),
    (dict(recompute_granularity="full"), "recompute_method"),
    (dict(recompute_granularity="partial"), "recompute_granularity"),
    (dict(cp_comm_type="ring"), "cp_comm_type"),
    (dict(hidden_size=0), "hidden_size"),
])
def test_invalid_transformer_config_names_its_field(changes, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**changes).validate()


@pytest.mark.parametrize("changes,field", [
    (dict(mask_token_id=None), "mask_token_id"),
    (dict(mask_token_id=VOCAB), "mask_token_id"),
    (dict(attention_mask_type="block_causal", block_size=None), "block_size"),
    (dict(attention_mask_type="block_causal", block_size=5), "block_size"),
    (dict(attention_mask_type="sliding_window"), "sliding_window"),
    (dict(model_running_mode="difflm"), "model_running_mode"),
    (dict(loss_weight="1/t"), "loss_weight"),
    (dict(loss_normalizer="batch"), "loss_normalizer"),
    (dict(t_sampling="sobol"), "t_sampling"),
    (dict(eps=1.0), "eps"),
])
def test_invalid_dlm_config_names_its_field(changes, field):
    with pytest.raises(ValueError, match=field):
        dlm_config(**changes).validate(vocab_size=VOCAB, seq_length=16)


def test_megatron_mask_name_is_accepted():
    assert dlm_config(attention_mask_type="causal_bottom_right").attention_mask_type == "causal"


def test_vocabulary_padding_is_never_predicted():
    ids = tokens(2, 16)
    losses = []
    for padded in (64, 96):
        config = tiny_config(vocab_size=padded, unpadded_vocab_size=VOCAB)
        torch.manual_seed(0)
        model = GPTModel(config, dlm_config()).eval()
        with torch.no_grad():
            logits = model(ids)
            if padded > VOCAB:
                assert torch.isinf(logits[..., VOCAB:]).all()
            losses.append(model.compute_loss(ids).loss)
    assert torch.isfinite(losses[0])
