"""Generation under tensor parallelism equals one process: the KV cache holds each rank's own
kv heads (tp=2 splits the groups; tp=4 with two kv heads splits their rows), and the logits are
gathered over the vocabulary. Sequence parallelism is refused with a clear message."""

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


def _generate_all(pg=None) -> dict:
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import DLMConfig

    ids = torch.randint(0, MASK_ID - 1, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    results = {}
    for mode in ("difflm-noshift", "vanilla"):
        torch.manual_seed(0)
        model = GPTModel(_config(), DLMConfig(model_running_mode=mode, mask_token_id=MASK_ID), pg=pg).eval()
        if mode == "vanilla":
            results[mode] = model.generate(ids, mask, max_new_tokens=8)
        else:
            results[mode] = model.generate(ids, mask, gen_length=8, steps=4, block_length=4, cache="dual", cfg=0.5)
    return results


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.core.transformer.transformer_config import DLMConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = _generate_all(state.groups)
    sequence_parallel = GPTModel(_config(sequence_parallel=True), DLMConfig(mask_token_id=MASK_ID),
                                 pg=state.groups).eval()
    try:
        sequence_parallel.generate(torch.tensor([[1, 2]]), gen_length=4)
        results["sp_error"] = ""
    except ValueError as error:
        results["sp_error"] = str(error)
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
        for mode in ("difflm-noshift", "vanilla"):
            assert torch.equal(got[mode], reference[mode]), (rank, mode)
        assert "sequence parallelism" in got["sp_error"]
