"""The fused loss under tensor parallelism (`linear_cross_entropy(..., compiled=True)` over 2 gloo ranks):
each rank's Triton row statistics, one all-gather, the gradient kernel, against one process computing the
whole vocabulary. Where Triton is installed (the dev extras) the kernels run under its interpreter on CPU;
without it the same call takes the eager passes, which must agree as well."""

import importlib.util

import pytest
import torch

from tests.distributed.parity import free_port, start_workers

pytestmark = pytest.mark.distributed

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOKENS, HIDDEN, PADDED = 37, 16, 56  # 28 vocabulary rows per rank


def _worker(rank: int, port: int, unpadded: int) -> None:
    import os

    import torch.distributed as dist

    from megatron.core.tensor_parallel import linear_cross_entropy as module
    from megatron.core.fusions import fused_cross_entropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls = []
    statistics = fused_cross_entropy.row_statistics
    fused_cross_entropy.row_statistics = lambda *args: calls.append(1) or statistics(*args)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    weight = torch.randn(PADDED, HIDDEN, generator=generator)
    targets = torch.randint(0, unpadded, (TOKENS,), generator=generator)
    loss_weights = torch.rand(TOKENS, generator=generator)
    loss_weights[3] = 0.0

    def run(weight_part, group, compiled):
        hidden_leaf, weight_leaf = hidden.clone().requires_grad_(), weight_part.clone().requires_grad_()
        losses, loss_sum = module.linear_cross_entropy(
            hidden_leaf, weight_leaf, targets, loss_weights, group, unpadded_vocab_size=unpadded,
            compute_dtype=torch.bfloat16, chunk_size=16, compiled=compiled)
        loss_sum.backward()
        return losses.detach(), loss_sum.detach(), hidden_leaf.grad, weight_leaf.grad

    rows = slice(rank * PADDED // 2, (rank + 1) * PADDED // 2)
    fused, eager = (list(run(weight[rows], dist.group.WORLD, compiled)) for compiled in (True, False))
    assert bool(calls) == HAS_TRITON, "the Triton kernels run wherever Triton is installed"
    for result in (fused, eager):
        dist.all_reduce(result[2])  # the caller's mapping sums the ranks' partial input gradients
    one_process = run(weight, None, compiled=False)
    for name, index in (("losses", 0), ("loss sum", 1)):
        torch.testing.assert_close(fused[index], eager[index], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(fused[index], one_process[index], rtol=1e-4, atol=1e-4, msg=name)
    # the bf16 logits gradients may round apart by one step and a CPU bf16 GEMM rounds its product (each
    # rank's partial one apart from one process's whole): a share of the largest gradient
    for got, want in ((fused[2], eager[2]), (fused[3], eager[3]), (fused[2], one_process[2]),
                      (fused[3], one_process[3][rows])):
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -5 * want.abs().max().item())
    if rows.start >= unpadded:
        assert not fused[3].any(), "a rank holding only padding gets no gradient"


@pytest.mark.parametrize("unpadded", [50, 27], ids=["padding on the last rank", "a rank of padding only"])
def test_the_fused_loss_over_two_ranks_matches_one_process(unpadded):
    start_workers(_worker, (free_port(), unpadded), nprocs=2)
