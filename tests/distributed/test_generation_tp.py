"""Generation under tensor parallelism equals one process: the KV cache holds each rank's own
kv heads (tp=2 splits the groups; tp=4 with two kv heads splits their rows), and the logits are
gathered over the vocabulary. A model built with sequence parallelism generates the same (the sampler
switches it off, and back on after)."""

import pytest
import torch

pytestmark = pytest.mark.distributed

VOCAB, MASK_ID = 64, 63


def _config(**changes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=48, vocab_size=VOCAB, qk_layernorm=True, attention_backend="math",
                             init_method_std=0.5, share_embeddings_and_output_weights=False,
                             **changes)


def _generate_all(pg=None, **changes) -> dict:
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import DLMConfig

    ids = torch.randint(0, MASK_ID - 1, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    results = {}
    for mode in ("difflm-noshift", "vanilla"):
        torch.manual_seed(0)
        model = GPTModel(_config(**changes), DLMConfig(model_running_mode=mode, mask_token_id=MASK_ID), pg=pg).eval()
        if mode == "vanilla":
            results[mode] = model.generate(ids, mask, max_new_tokens=8)
        else:
            results[mode] = model.generate(ids, mask, gen_length=8, steps=4, block_length=4, cache="dual", cfg=0.5)
        results[f"{mode} sequence parallel after"] = any(getattr(module, "sequence_parallel", False) is True
                                                         for module in model.modules())
    return results


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from megatron.core.parallel_state import initialize_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = {"tp": _generate_all(state.groups), "tp_sp": _generate_all(state.groups, sequence_parallel=True)}
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_generation_equals_one_process(world_size, tmp_path):

    from tests.distributed.parity import free_port, start_workers

    out = str(tmp_path / "generation")
    start_workers(_worker, (world_size, free_port(), out), world_size)
    reference = _generate_all()
    for rank in range(world_size):
        got = torch.load(f"{out}.{rank}")
        for layout, mode in [(layout, mode) for layout in ("tp", "tp_sp") for mode in ("difflm-noshift", "vanilla")]:
            assert torch.equal(got[layout][mode], reference[mode]), (rank, layout, mode)
            assert got[layout][f"{mode} sequence parallel after"] == (layout == "tp_sp"), (rank, layout, mode)
