"""The MoE layer's pieces against definitions written out here: routing, the balancing losses,
the expert-bias update, capacity dropping, expert choice and the layer freq
(the grouped GEMM: test_moe_grouped_gemm.py)."""

import math

import pytest
import torch

from megatron.core.models.difflm.diffusion import CorruptionKey
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.moe.balancing import finish_router_step
from megatron.core.transformer.moe.config import MoEConfig, parse_layer_freq
from megatron.core.transformer.moe.experts import GroupedExperts
from megatron.core.transformer.moe.moe_layer import MoELayer, routers
from megatron.core.transformer.moe.router import ExpertChoiceRouter, TopKRouter
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig


def dense(routing):
    """(probs [T, E], routing_map [T, E]) of a Routing."""
    return routing.dense_probs(), routing.routing_map


def config(**moe) -> TransformerConfig:
    torch.manual_seed(0)
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                             moe=MoEConfig(**{"num_experts": 4, "router_topk": 2, **moe}))


def test_topk_routing_matches_its_definitions():
    tokens = torch.randn(12, 16)
    for options, expected in [
        ({}, lambda logits: torch.softmax(logits.topk(2).values, -1)),  # softmax over the top-k logits
        ({"router_pre_softmax": True}, lambda logits: torch.softmax(logits, -1).topk(2).values),
        ({"router_score_function": "sigmoid"},
         lambda logits: torch.sigmoid(logits).topk(2).values / torch.sigmoid(logits).topk(2).values.sum(-1, True)),
    ]:
        router = TopKRouter(config(**options))
        logits = tokens @ router.weight.t()
        probs, routing_map = dense(router(tokens, (12, 1)))
        assert routing_map.sum(-1).eq(2).all()
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(-1, logits.topk(2).indices, True))
        torch.testing.assert_close(probs[routing_map].view(12, 2).sort(-1).values, expected(logits).sort(-1).values)
        assert probs[~routing_map].eq(0).all()


def test_aux_loss_and_z_loss_equal_the_formulas():
    """Switch/GShard aux = coeff * E * sum_e f_e * P_e (f_e: the fraction of the T*k assignments going to e,
    P_e: e's mean score), the sequence-wise one averaged over sequences, z = coeff * mean(logsumexp^2)."""
    s, b, experts, k = 6, 2, 4, 2
    tokens = torch.randn(s * b, 16)
    router = TopKRouter(config(aux_loss_coeff=0.1, z_loss_coeff=0.01))
    logits = router.gate(tokens)
    _, routing_map = dense(router.route(logits, (s, b)))
    aux, z = router.balancing_losses(logits, routing_map, (s, b))
    scores = torch.softmax(logits, -1)
    fraction = [routing_map[:, e].sum().item() / (s * b * k) for e in range(experts)]
    mean_score = [scores[:, e].mean().item() for e in range(experts)]
    expected_aux = 0.1 * experts * sum(f * p for f, p in zip(fraction, mean_score))
    expected_z = 0.01 * sum(torch.logsumexp(logits[t], 0).item() ** 2 for t in range(s * b)) / (s * b)
    assert math.isclose(aux.item(), expected_aux, rel_tol=1e-5) and math.isclose(z.item(), expected_z, rel_tol=1e-5)

    router = TopKRouter(config(aux_loss_coeff=0.1, router_load_balancing_type="seq_aux_loss"))
    logits = router.gate(tokens)
    _, routing_map = dense(router.route(logits, (s, b)))
    aux, _ = router.balancing_losses(logits, routing_map, (s, b))
    scores, per_sequence = torch.softmax(logits, -1).view(s, b, experts), routing_map.view(s, b, experts)
    expected = sum(0.1 * experts * sum(per_sequence[:, j, e].sum().item() / (s * k) * scores[:, j, e].mean().item()
                                       for e in range(experts)) for j in range(b)) / b
    assert math.isclose(aux.item(), expected, rel_tol=1e-5)


def test_balancing_losses_reach_the_gradients_with_the_given_scale():
    """d(output-based loss)/dW + scale * d(aux + z)/dW: the scale the loop passes is the normalizer."""
    layer = MoELayer(config(aux_loss_coeff=0.1, z_loss_coeff=0.01))
    hidden = torch.randn(5, 2, 16)
    grads = {}
    for scale in (None, torch.tensor(3.0)):
        layer.zero_grad()
        layer.router.aux_loss_scale = scale
        layer(hidden).sum().backward()
        grads[scale is None] = layer.router.weight.grad.clone()
    layer.zero_grad()
    logits = layer.router.gate(hidden.view(10, 16))
    _, routing_map = dense(layer.router.route(logits, (5, 2)))
    layer.router.balancing_losses(logits, routing_map, (5, 2)).sum().backward()
    torch.testing.assert_close(grads[False] - grads[True], 2.0 * layer.router.weight.grad)


def test_expert_bias_steers_selection_and_follows_the_update_rule():
    router = TopKRouter(config(router_score_function="sigmoid", router_enable_expert_bias=True,
                               router_bias_update_rate=0.05))
    router.train()
    tokens = torch.randn(32, 16, requires_grad=True)
    _, routing_map = dense(router(tokens, (32, 1)))
    counts = routing_map.sum(0).double()
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, moe=router.moe)
    router.layer_number = 0
    stats = finish_router_step(router, cfg, microbatches_per_step=1)
    torch.testing.assert_close(router.expert_bias, (0.05 * torch.sign(counts.mean() - counts)).float())
    assert stats.max_load[0] == pytest.approx(float(counts.max() / counts.mean()))
    assert router.tokens_per_expert.eq(0).all()
    # A large bias on expert 3 makes every token pick it; the probabilities stay the unbiased scores'.
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    probs, routing_map = dense(router(tokens, (32, 1)))
    assert routing_map[:, 3].all()
    scores = torch.sigmoid(router.gate(tokens))
    chosen = (scores * routing_map)
    torch.testing.assert_close(probs, chosen / chosen.sum(-1, keepdim=True))


def test_capacity_drops_the_lowest_probability_assignments():
    router = TopKRouter(config(expert_capacity_factor=0.5))
    tokens = torch.randn(16, 16)
    logits = router.gate(tokens)
    probs, routing_map = dense(router.route(logits, (16, 1)))
    capacity = math.ceil(16 * 2 / 4 * 0.5)
    full_probs, full_map = dense(TopKRouter(config()).route(logits, (16, 1)))
    for e in range(4):
        kept = routing_map[:, e]
        assert kept.sum() == min(capacity, full_map[:, e].sum())
        if full_map[:, e].sum() > capacity:
            dropped = full_map[:, e] & ~kept
            assert full_probs[kept, e].min() >= full_probs[dropped, e].max()


def test_expert_choice_takes_the_top_tokens_of_each_sequence_per_expert():
    router = ExpertChoiceRouter(config(router_type="expert_choice", router_topk=2))
    s, b = 8, 3
    tokens = torch.randn(s * b, 16)
    probs, routing_map = dense(router(tokens, (s, b)))
    scores = torch.softmax(router.gate(tokens), -1).view(s, b, 4)
    capacity = s * 2 // 4
    per_sequence = routing_map.view(s, b, 4)
    for j in range(b):
        for e in range(4):
            expected = torch.zeros(s, dtype=torch.bool)
            expected[scores[:, j, e].topk(capacity).indices] = True
            assert torch.equal(per_sequence[:, j, e], expected)
    torch.testing.assert_close(probs, (scores * per_sequence).view(s * b, 4))


def test_expert_choice_is_refused_for_autoregressive_models():
    cfg = config(router_type="expert_choice")
    with pytest.raises(ValueError, match="vanilla"):
        GPTModel(cfg, DLMConfig(model_running_mode="vanilla"))
    GPTModel(cfg, DLMConfig(mask_token_id=63))


def test_dropless_fast_path_equals_the_routing_map_path():
    """Dropless token choice sorts the top-k ids and sums k outputs per token; the general path reads the
    routing map and index-adds: the same outputs and gradients."""
    from megatron.core.transformer.moe.router import Routing

    layer = MoELayer(config(aux_loss_coeff=0.1))
    hidden = torch.randn(6, 2, 16, requires_grad=True)
    results = []
    for through_map in (False, True):
        route = layer.router.route
        if through_map:
            layer.router.route = lambda logits, shape: (lambda r: Routing(r.routing_map, probs=r.dense_probs()))(
                route(logits, shape))
        layer.zero_grad()
        output = layer(hidden)
        grad, = torch.autograd.grad(output.square().sum(), hidden, retain_graph=True)
        output.square().sum().backward()
        results.append((output, grad, layer.router.weight.grad.clone(), layer.experts.linear_fc1.weight.grad.clone()))
        layer.router.route = route
    for fast, general in zip(*results):
        torch.testing.assert_close(fast, general)


def test_experts_are_the_single_process_weights_in_every_layout():
    cfg = config(ffn_hidden_size=8)
    whole = GroupedExperts(cfg, layer_number=1)
    parts = [GroupedExperts(cfg, 1, ep_rank=p, ep_size=2, etp_rank=q, etp_size=2) for p in range(2) for q in range(2)]
    fc1 = whole.linear_fc1.weight.view(4, 2, 8, 16)
    for index, part in enumerate(parts):
        p, q = divmod(index, 2)
        torch.testing.assert_close(part.linear_fc1.weight.view(2, 2, 4, 16), fc1[2 * p:2 * p + 2, :, 4 * q:4 * q + 4])
        piece = part.sharded_state_dict()["linear_fc2.weight"]
        assert piece.global_shape == (4, 16, 8) and piece.global_offset == (2 * p, 0, 4 * q)


def test_the_layout_the_experts_need_is_checked_on_the_flags_before_any_build(capsys):
    from megatron.training.arguments import parse_args
    from tests.unit_tests.test_training import TINY

    moe = MoEConfig(num_experts=4, router_topk=2)
    moe.check_layout(32, tp_size=2, ep_size=4, etp_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide the 4 experts"):
        moe.check_layout(32, tp_size=1, ep_size=3, etp_size=1, sequence_parallel=False)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 3 does not divide the expert ffn size 32"):
        moe.check_layout(32, tp_size=1, ep_size=1, etp_size=3, sequence_parallel=False)
    with pytest.raises(ValueError, match="add --sequence-parallel"):
        moe.check_layout(32, tp_size=2, ep_size=1, etp_size=1, sequence_parallel=False)
    flags = TINY + ["--train-iters", "1", "--num-experts", "4", "--moe-router-topk", "2",
                    "--expert-model-parallel-size", "3"]
    with pytest.raises(SystemExit):
        parse_args(flags, world_size=3)
    assert "--expert-model-parallel-size 3 does not divide the 4 experts" in capsys.readouterr().err


def test_layer_freq_forms():
    assert parse_layer_freq(2, 5) == [1, 0, 1, 0, 1]
    assert parse_layer_freq("[0]*1+[1]*3", 4) == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="each of the 4 layers"):
        parse_layer_freq("[0]*1+[1]*2", 4)
    with pytest.raises(ValueError, match="is not a list"):
        parse_layer_freq("__import__('os')", 4)
    cfg = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2, vocab_size=64,
                            moe=MoEConfig(num_experts=2, router_topk=1, layer_freq="[0]+[1]*2"))
    model = GPTModel(cfg)
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers.values()] == ["MLP", "MoELayer", "MoELayer"]
    assert [router.layer_number for router in routers(model)] == [1, 2]


def test_an_unnormalized_loss_weights_the_balancing_losses_by_the_normalizer():
    """The loss sum the trainer backpropagates (pretrain_difflm.forward_step: loss_normalizer 1, the
    balancing losses weighted by the micro-batch's normalizer) gives normalizer times the gradients of
    compute_loss's mean loss, the routers' balancing terms included."""
    from megatron.core.models.difflm import objective

    torch.manual_seed(0)
    model = GPTModel(config(aux_loss_coeff=0.1, z_loss_coeff=0.01), DLMConfig(mask_token_id=63))
    tokens = torch.randint(0, 60, (2, 8))
    key = CorruptionKey.for_batch(0, iteration=1, global_batch_size=2, first_sample_index=0, batch_size=2)
    mean = model.compute_loss(tokens, key=key)
    mean.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model_input, weights, normalizer, _ = objective.loss_inputs(tokens, model.dlm_config, key,
                                                                clamp_normalizer=False)
    _, loss_sum = model(model_input, labels=tokens, loss_weights=weights, loss_normalizer=1.0,
                        aux_loss_scale=normalizer)
    loss_sum.backward()
    assert "router" in " ".join(grads) and float(normalizer) == float(mean.normalizer) > 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name] * normalizer, rtol=1e-5, atol=1e-6, msg=name)
