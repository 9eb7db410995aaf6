"""The fused float8 SwiGLU MLP (float8_mlp.py) under TP=2 with sequence parallelism on gloo: every rank's
output, input gradient, weight-shard gradients and recorded amaxes equal those of the same rank running
the MLP's two float8 layers one after the other, over two iterations of delayed scaling (the first by
the tensors' own amaxes, the second by the scales the first set, shared over the tensor-parallel peers).
It fails if the fused function gathered the input, reduced the output or added fc2's bias otherwise than
the layers do, or scaled a shard otherwise. (Against one process, where float8's per-shard rounding
differs: the training runs of tests/distributed/test_weight_copies_parallel.py.)"""

import torch

from tests.distributed.parity import free_port, start_workers


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from megatron.core.parallel_state import ProcessGroups
    from megatron.core.fp8 import float8_mlp
    from megatron.core.fp8.float8_scaling import DelayedScalingConfig
    from megatron.core.precision.weight_copies import WeightCopies
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               gated_linear_unit=True, activation="silu", add_bias_linear=False,
                               sequence_parallel=True)
    pg = ProcessGroups(tp=dist.group.WORLD)
    fused = MLP(config, pg=pg)
    layered = MLP(config, pg=pg)  # the same weights: each drawn from its own seed
    copies = [WeightCopies(m, torch.bfloat16, "hybrid", DelayedScalingConfig(), [pg.tp]) for m in (fused, layered)]
    generator = torch.Generator().manual_seed(5)
    x, grad = torch.randn(32, 2, 32, generator=generator), torch.randn(32, 2, 32, generator=generator) * 1e-2
    local = slice(16 * rank, 16 * (rank + 1))  # this rank's sequence chunk
    assert fused.fused_forward is float8_mlp.swiglu_mlp  # installed by the converter
    layered.fused_forward = None  # layer by layer
    results = {}
    for name, module in (("fused", fused), ("layered", layered)):
        results[name] = []
        for scale in (1.0, 3.0):
            inputs = (x[local] * scale).requires_grad_()
            for parameter in module.parameters():
                parameter.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = module(inputs)
            output.float().backward(grad[local])
            results[name] += [output.float(), inputs.grad] + [p.grad for p in module.parameters()]
            results[name] += [module.linear_fc1.gemm.amax.clone(), module.linear_fc2.gemm.amax.clone()]
            copies[name == "layered"].end_iteration()
    torch.save(results, f"{out}.{rank}")


def test_the_fused_float8_mlp_under_tensor_and_sequence_parallelism_is_its_layers(tmp_path):
    out = str(tmp_path / "mlp")
    start_workers(_worker, (2, free_port(), out), 2)
    for rank in range(2):
        results = torch.load(f"{out}.{rank}")
        assert len(results["fused"]) == len(results["layered"]) == 2 * 6
        for index, (ours, theirs) in enumerate(zip(results["fused"], results["layered"])):
            assert torch.equal(ours, theirs), (rank, index)
