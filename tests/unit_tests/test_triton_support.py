"""triton_support.LazyOp: the kernels' ops registered once, on first use, and read (never registered)
by compiled code. Fails if a second call registers again, if the first call does not register, or if
torch.compile cannot trace the call in one graph (SwiGLU and the float8 casts sit inside
compiled layers)."""

import torch

from megatron.core.fusions.triton_support import LazyOp


def test_a_lazy_op_registers_once_and_compiled_code_reads_it():
    registered = []

    def register():
        @torch.library.custom_op("megadlms_test::lazy_double", mutates_args=())
        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @double.register_fake
        def _(x):
            return torch.empty_like(x)
        registered.append(double)
        return double

    op = LazyOp(register)
    assert registered == []
    assert op() is op() is registered[0] and len(registered) == 1
    compiled = torch.compile(lambda x: op()(x) + 1, fullgraph=True)  # a graph break would raise here
    x = torch.randn(5)
    assert torch.equal(compiled(x), x * 2 + 1)
    assert len(registered) == 1
