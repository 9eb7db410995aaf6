"""The full-width QK-norm (`qk_layernorm_scope='all'`, OLMoE) under tensor parallelism.

Each tp rank holds other heads, so the norm over all heads' channels needs the sum of squares
of every rank (all-reduced, gradients too) and each rank's slice of the global norm weight. Two
gloo processes run one attention layer at TP=2 loaded from a single-process reference through
the checkpoint description (`sharded_state_dict`): the output, the input gradient and every
parameter gradient must be the reference's. Both QKV layouts: TP = kv heads (the fused
projection) and TP > kv heads (keys gathered, the key norm whole on every rank).
"""

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.distributed

CASES = {  # name: (kv heads, normalization)
    "fused_qkv_rmsnorm": (2, "RMSNorm"),
    "split_kv_layernorm": (1, "LayerNorm"),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(groups: int, normalization: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                             kv_channels=8, ffn_hidden_size=32, vocab_size=64, qk_layernorm=True,
                             qk_layernorm_scope="all", normalization=normalization, attention_backend="math").validate()


def _run(model, hidden, weights):
    """Output, input gradient and the parameters' global gradients (keyed like the checkpoint)."""
    hidden = hidden.clone().requires_grad_(True)
    output = model(hidden)
    (output * weights).sum().backward()
    grads = {}
    for key, piece in model.sharded_state_dict().items():
        param = next(p for p in model.parameters() if p.data_ptr() == piece.data.data_ptr())
        grad = param.grad.view(piece.data.shape)
        if getattr(param, "allreduce_over_tp", False):  # partial sums, as the data-parallel wrapper adds them
            grad = grad.clone()
            torch.distributed.all_reduce(grad, group=model.tp_group)
        grads[key] = (piece.key, grad, piece.global_offset)
    return output.detach(), hidden.grad, grads


def _load_from(reference, model) -> None:
    """Every rank's pieces cut from the reference's global tensors."""
    whole = {key: piece.data for key, piece in reference.sharded_state_dict().items()}
    with torch.no_grad():
        for key, piece in model.sharded_state_dict().items():
            index = tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.data.shape))
            piece.data.copy_(whole[piece.key][index])


def _case(state, groups: int, normalization: str) -> dict:
    from megatron.core.transformer.attention import DiffLMSelfAttention
    from megatron.core.transformer.transformer_config import DLMConfig

    dlm = DLMConfig(model_running_mode="vanilla")
    reference = DiffLMSelfAttention(_config(groups, normalization), dlm)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights (and biases) away from 1 / 0: a wrong slice shows
        for name, param in reference.named_parameters():
            if "layernorm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model = DiffLMSelfAttention(_config(groups, normalization), dlm, pg=state.groups)
    _load_from(reference, model)
    hidden = torch.randn(6, 2, 32, generator=generator)
    weights = torch.randn(6, 2, 32, generator=generator)
    return {"reference": _run(reference, hidden, weights), "parallel": _run(model, hidden, weights)}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron.core.parallel_state import initialize_model_parallel

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the weights' init seeds derive from it: the same reference on both ranks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        state = initialize_model_parallel(tensor_model_parallel_size=2)
        torch.save({case: _case(state, *CASES[case]) for case in CASES}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_full_width_qk_norm_under_tp_matches_one_process(tmp_path):
    from tests.distributed.parity import start_workers

    out = str(tmp_path / "results")
    start_workers(_worker, (_free_port(), out), 2)
    for rank in range(2):
        for case, results in torch.load(f"{out}.{rank}").items():
            _check(case, results)


def _check(case: str, results: dict) -> None:
    (out_ref, input_ref, grads_ref), (out_tp, input_tp, grads_tp) = results["reference"], results["parallel"]
    torch.testing.assert_close(out_tp, out_ref, rtol=1e-5, atol=1e-6, msg=f"{case}: output")
    torch.testing.assert_close(input_tp, input_ref, rtol=1e-5, atol=1e-6, msg=f"{case}: input gradient")
    assert {key for key, _, _ in grads_tp.values()} == set(grads_ref)
    for key, grad, offset in grads_tp.values():
        index = tuple(slice(o, o + n) for o, n in zip(offset, grad.shape))
        torch.testing.assert_close(grad, grads_ref[key][1][index], rtol=1e-5, atol=1e-6, msg=f"{case}: {key}")
    norms = {key: grad.shape for key, grad, _ in grads_tp.values() if "layernorm" in key}
    assert norms["q_layernorm.weight"] == (16,), case  # this rank's two heads of the global 4 x 8
