"""compile_transformer_layers: compiled layers give eager's loss and gradients, alone and under
activation recompute, and keep the parameter names; --torch-compile applies it in build_trainer."""

import pytest
import torch

from megatron.core.models.difflm import diffusion
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.compilation import compile_transformer_layers
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig


def inductor_available() -> bool:
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception:  # no C++ compiler for inductor's CPU kernels on this machine
        return False
    return True


pytestmark = pytest.mark.skipif(not inductor_available(),
                                reason="torch.compile (inductor) cannot build CPU kernels here")


def loss_and_grads(model: GPTModel, tokens: torch.Tensor):
    key = diffusion.CorruptionKey.for_batch(7, iteration=1, global_batch_size=2, first_sample_index=2, batch_size=2)
    out = model.compute_loss(tokens, key=key)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [{}, dict(recompute_granularity="selective"),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1)], ids=["plain", "selective", "full"])
def test_compiled_layers_match_eager(recompute):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, vocab_size=64, max_position_embeddings=32, qk_layernorm=True,
                               attention_backend="sdpa", **recompute)
    dlm = DLMConfig(mask_token_id=63, masked_only_loss=True)
    tokens = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    eager = GPTModel(config, dlm).train()
    torch.manual_seed(0)
    compiled = GPTModel(config, dlm).train()
    names = list(compiled.state_dict())
    assert compile_transformer_layers(compiled) == 2
    assert all(layer._compiled_call_impl is not None for layer in compiled.decoder.layers.values())
    assert list(compiled.state_dict()) == names, "compiling in place keeps the checkpoint keys"
    expected_loss, expected = loss_and_grads(eager, tokens)
    loss, grads = loss_and_grads(compiled, tokens)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)


def test_compiled_moe_layers_match_eager():
    """The dropless MoE path has no host sync, so the layer compiles whole (the router's statistics
    stay eager): the same loss, gradients and router statistics as eager."""
    from megatron.core.transformer.moe.config import MoEConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               vocab_size=64, max_position_embeddings=32, attention_backend="sdpa",
                               moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16, aux_loss_coeff=0.01,
                                             z_loss_coeff=1e-3, shared_expert_intermediate_size=24))
    dlm = DLMConfig(mask_token_id=63)
    tokens = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(0))
    models = []
    for compile_layers in (False, True):
        torch.manual_seed(0)
        models.append(GPTModel(config, dlm).train())
        if compile_layers:
            assert compile_transformer_layers(models[-1]) == 2
    (expected_loss, expected), (loss, grads) = (loss_and_grads(model, tokens) for model in models)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)
    for eager, compiled in zip(models[0].routers, models[1].routers):
        assert torch.equal(compiled.tokens_per_expert, eager.tokens_per_expert) and eager.tokens_per_expert.sum() > 0
        torch.testing.assert_close(compiled.loss_sums, eager.loss_sums)


def test_torch_compile_flag_compiles_the_layers_in_build_trainer():
    import pretrain_difflm
    from custom_args.difflm import add_difflm_args
    from megatron.core.distributed.data_parallel import unwrap
    from megatron.training.initialize import initialize_distributed
    from megatron.training.run_config import parse_run_config
    from megatron.training.training import build_trainer

    from tests.unit_tests.test_training import TINY

    config = parse_run_config(TINY + ["--train-iters", "1", "--torch-compile"], add_difflm_args, world_size=1)
    trainer = build_trainer(config, initialize_distributed("gloo"), pretrain_difflm.train_valid_test_datasets_provider,
                            pretrain_difflm.model_provider, pretrain_difflm.forward_step)
    layers = list(unwrap(trainer.model).decoder.layers.values())
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)


def test_compiled_layers_generate_as_eager_with_one_graph_set_for_all_layers():
    """Generation through compiled layers: the same tokens as eager, and the KV cache's update
    stays outside the graphs, so 4 layers and every cache offset share a few compiled graphs
    instead of recompiling per layer (which would hit dynamo's limit and fall back to eager)."""
    from torch._dynamo.utils import counters

    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, vocab_size=64, max_position_embeddings=64, qk_layernorm=True,
                               attention_backend="sdpa")
    dlm = DLMConfig(mask_token_id=63)
    prompt = torch.randint(0, 63, (2, 6), generator=torch.Generator().manual_seed(3))
    options = dict(gen_length=16, block_length=4, steps=16, cache="dual")
    outputs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPTModel(config, dlm).eval()
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_transformer_layers(model, dynamic=True)
        with torch.no_grad():
            outputs.append(model.generate(prompt, **options))
    assert torch.equal(outputs[0], outputs[1])
    assert 0 < counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])


def test_dynamic_compilation_raises_dynamo_recompile_limit_for_generation_shapes():
    """Generation's shapes (batch 1 or more, one token or more, cache or none) can need more
    graphs than dynamo's default 8; past the limit the layers would silently run eagerly."""
    from megatron.core.transformer.compilation import DYNAMIC_RECOMPILE_LIMIT

    def tiny() -> GPTModel:
        return GPTModel(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                          vocab_size=64))

    config = torch._dynamo.config
    saved = config.recompile_limit
    try:
        config.recompile_limit = 8
        compile_transformer_layers(tiny())
        assert config.recompile_limit == 8  # static compilation (training) leaves it alone
        compile_transformer_layers(tiny(), dynamic=True)
        assert config.recompile_limit == DYNAMIC_RECOMPILE_LIMIT > 8
        config.recompile_limit = 100
        compile_transformer_layers(tiny(), dynamic=True)
        assert config.recompile_limit == 100  # never lowered
    finally:
        config.recompile_limit = saved
