"""Tensor-parallel layers, mappings, loss and RNG streams on gloo equal the single-process computation.

One spawn per world size runs every case on every rank (over the whole world as the tp
group, and at world size 4 also over the strided tp groups [0, 2] and [1, 3], so a layer
that confused global and group ranks fails); the test process computes the reference
with `tp_group=None` and compares each case.
"""

import datetime
import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist

from tests.distributed.parity import start_workers
import torch.nn.functional as F

from megatron.core import tensor_parallel as tp
from megatron.core.tensor_parallel import mappings

pytestmark = pytest.mark.distributed

S, B, H, FFN, V = 4, 2, 8, 8, 12
STD = 0.5
TOL = dict(rtol=1e-6, atol=1e-6)
FULL, SUM = ("full",), ("sum",)


def split(dim, view=None, split_dim=0):
    """Layout of a tensor whose `dim`, read as `view`, is split across tp ranks on `split_dim` of the view."""
    return ("split", dim, view, split_dim)


GATED = ((2, FFN), 1)  # fc1 of a gated MLP: output viewed as [gate; up], split on the ffn dim
GATED_KW = dict(output_view=GATED[0], split_dim=1)
COLUMN, ROW, EMBEDDING = tp.ColumnParallelLinear, tp.RowParallelLinear, tp.VocabParallelEmbedding


def layer_case(cls, size_in, size_out, seed, x, x_layout, y, weight, bias=None, **kwargs):
    """A layer built the same way on every rank and in the reference, and how its tensors are split."""
    if bias is not None:
        kwargs["bias"] = True
    return dict(cls=cls, size=(size_in, size_out), seed=seed, kwargs=kwargs, x=x, x_layout=x_layout, y=y,
                weight=weight, bias=bias)


CASES = {
    "column": layer_case(COLUMN, H, FFN, 1, "x_h", FULL, split(-1), split(0), split(0)),
    "column_gated": layer_case(COLUMN, H, 2 * FFN, 2, "x_h", FULL, split(-1, *GATED), split(0, *GATED),
                               split(0, *GATED), **GATED_KW),
    "column_gather": layer_case(COLUMN, H, 2 * FFN, 3, "x_h", FULL, FULL, split(0, *GATED), split(0, *GATED),
                                gather_output=True, **GATED_KW),
    "column_plain_gather": layer_case(COLUMN, H, FFN, 4, "x_h", FULL, FULL, split(0), gather_output=True),
    "column_sp": layer_case(COLUMN, H, FFN, 5, "x_h", split(0), split(-1), split(0), split(0), sequence_parallel=True),
    "row": layer_case(ROW, FFN, H, 6, "x_f", split(-1), FULL, split(1), FULL),
    "row_scatter_input": layer_case(ROW, FFN, H, 7, "x_f", FULL, FULL, split(1), FULL, input_is_parallel=False),
    "row_sp": layer_case(ROW, FFN, H, 8, "x_f", split(-1), split(0), split(1), SUM, sequence_parallel=True),
    "embedding": layer_case(EMBEDDING, V, H, 9, "ids", FULL, FULL, split(0)),
    "embedding_sp": layer_case(EMBEDDING, V, H, 10, "ids", FULL, split(0), split(0), sequence_parallel=True),
}


def make_layer(name, group):
    spec = CASES[name]
    return spec["cls"](*spec["size"], tp_group=group, init_std=STD, init_seed=spec["seed"], **spec["kwargs"])


def master_weight(name):
    """The full weight every rank slices: [out, in] for linears, [vocab, dim] for the embedding."""
    spec = CASES[name]
    size_in, size_out = spec["size"]
    shape = (size_in, size_out) if spec["cls"] is EMBEDDING else (size_out, size_in)
    return tp.init_master_weight(shape, STD, spec["seed"], torch.float32)


def take(tensor, layout, rank, n):
    """This rank's piece of `tensor` under `layout` (the test's own slicing, not the layers')."""
    if layout[0] != "split":
        return tensor
    _, dim, view, split_dim = layout
    dim %= tensor.dim()
    view = view or (tensor.shape[dim],)
    viewed = tensor.reshape(*tensor.shape[:dim], *view, *tensor.shape[dim + 1:])
    size = view[split_dim] // n
    piece = viewed.narrow(dim + split_dim, rank * size, size)
    return piece.reshape(*tensor.shape[:dim], -1, *tensor.shape[dim + 1:]).contiguous()


def assemble(pieces, layout):
    """The inverse of `take`: the full tensor from every rank's piece."""
    _, dim, view, split_dim = layout
    first, n = pieces[0], len(pieces)
    dim %= first.dim()
    local_view = list(view or (first.shape[dim] * n,))
    local_view[split_dim] //= n
    viewed = [p.reshape(*p.shape[:dim], *local_view, *p.shape[dim + 1:]) for p in pieces]
    whole = torch.cat(viewed, dim=dim + split_dim)
    return whole.reshape(*first.shape[:dim], -1, *first.shape[dim + 1:])


def check(pieces, layout, expected, what):
    if layout == FULL:
        for rank, piece in enumerate(pieces):
            torch.testing.assert_close(piece, expected, **TOL, msg=f"{what} on tp rank {rank}")
    elif layout == SUM:
        torch.testing.assert_close(sum(pieces), expected, **TOL, msg=what)
    else:
        torch.testing.assert_close(assemble(pieces, layout), expected, **TOL, msg=what)


def full_inputs():
    gen = torch.Generator().manual_seed(1234)
    ids = torch.tensor([[0, 11], [5, 5], [3, 8], [11, 6]])  # every vocab shard at tp 4, a repeated id
    return {"x_h": torch.randn(S, B, H, generator=gen), "x_f": torch.randn(S, B, FFN, generator=gen), "ids": ids,
            "logits": torch.randn(S, B, V, generator=gen), "loss_grad": torch.randn(S, B, generator=gen)}


def output_grad(case):
    return torch.randn(S, B, CASES[case]["size"][1], generator=torch.Generator().manual_seed(100 + CASES[case]["seed"]))


def bias_values(case):
    """A nonzero full bias, so forward parity and checkpoint offsets also test its layout."""
    return torch.linspace(-1.0, 1.0, CASES[case]["size"][1])


def build(case, group, rank, n):
    layer = make_layer(case, group)
    if getattr(layer, "bias", None) is not None:
        layout = CASES[case]["bias"]
        with torch.no_grad():
            layer.bias.copy_(take(bias_values(case), FULL if layout == SUM else layout, rank, n))
    return layer


def run_case(case, group, rank, n):
    spec, inputs = CASES[case], full_inputs()
    layer = build(case, group, rank, n)
    x = take(inputs[spec["x"]], spec["x_layout"], rank, n)
    if x.is_floating_point():
        x.requires_grad_()
    y = layer(x)
    y.backward(take(output_grad(case), spec["y"], rank, n))
    return {"y": y.detach(), "x_grad": x.grad, "grads": {k: p.grad for k, p in layer.named_parameters()},
            "sharded": {k: (s.data.clone(), s.global_shape, s.global_offset, s.replica_id)
                        for k, s in layer.sharded_state_dict(f"{case}.").items()},
            "attrs": {k: (p.tensor_model_parallel, p.partition_dim) for k, p in layer.named_parameters()}}


def run_cross_entropy(group, rank, n):
    inputs = full_inputs()
    logits = take(inputs["logits"], split(-1), rank, n).requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(logits, inputs["ids"], group)
    loss.backward(inputs["loss_grad"])
    rejected = []
    for bad in (V, -1):
        try:
            tp.vocab_parallel_cross_entropy(logits, torch.full((S, B), bad), group)
        except ValueError:
            rejected.append(bad)
    return {"loss": loss.detach(), "grad": logits.grad, "rejected": rejected}


def run_mappings(group, rank):
    base = torch.randn(4, 4, 4, generator=torch.Generator().manual_seed(77))
    funcs = {
        "copy": tp.copy_to_tensor_model_parallel_region, "reduce": tp.reduce_from_tensor_model_parallel_region,
        "scatter_tp": tp.scatter_to_tensor_model_parallel_region,
        "gather_tp": tp.gather_from_tensor_model_parallel_region,
        "scatter_sp": tp.scatter_to_sequence_parallel_region, "gather_sp": tp.gather_from_sequence_parallel_region,
        "gather_sp_split": functools.partial(tp.gather_from_sequence_parallel_region,
                                             tensor_parallel_output_grad=False),
        "reduce_scatter_sp": tp.reduce_scatter_to_sequence_parallel_region,
    }
    out = {}
    for name, func in funcs.items():
        x = (base + rank).requires_grad_()
        y = func(x, group)
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank))
        y.backward(grad)
        out[name] = {"x": x.detach(), "y": y.detach(), "gy": grad, "x_grad": x.grad}
    x = base + rank
    out["helpers"] = {"gather_list": mappings._all_gather_list(x, 1, group),
                      "gather_fused": mappings._all_gather_fused(x, 1, group),
                      "rs_list": mappings._reduce_scatter_list(x, 1, group),
                      "rs_fused": mappings._reduce_scatter_fused(x, 1, group), "x": x}
    return out


def run_rng(tp_rank):
    tracker = tp.model_parallel_rng_tracker(1234, tp_rank)
    mask = lambda: F.dropout(torch.ones(64), 0.5) != 0  # noqa: E731
    torch.manual_seed(42)
    expected_outside = mask()
    torch.manual_seed(42)
    before = torch.get_rng_state()
    with tracker.fork():
        inside = mask()
    restored = torch.equal(before, torch.get_rng_state())
    outside = mask()
    with tracker.fork():
        inside_again = mask()
    return {"inside": inside, "inside_again": inside_again, "outside": outside,
            "expected_outside": expected_outside, "restored": restored}


def run_all(group, group_id):
    tp_rank, n = dist.get_rank(group), dist.get_world_size(group)
    result = {"tp_rank": tp_rank, "tp_size": n, "group_id": group_id,
              "cases": {case: run_case(case, group, tp_rank, n) for case in CASES},
              "cross_entropy": run_cross_entropy(group, tp_rank, n)}
    try:
        make_layer("embedding", group)(torch.full((1, 1), V))
    except IndexError:
        result["embedding_rejects_out_of_range"] = True
    return result


def _worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    try:
        world = dist.new_group(list(range(world_size)))
        result = {"world": run_all(world, 0), "mappings": run_mappings(world, rank),
                  "rng": run_rng(dist.get_rank(world))}
        if world_size == 4:
            strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            result["strided"] = run_all(strided[rank % 2], rank % 2)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def ranks(request, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp(f"tp{request.param}"))
    start_workers(_worker, (request.param, free_port(), out_dir), request.param)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(request.param)]


def tp_groups(ranks):
    """Per tp group, its members' results ordered by tp rank (whole world, and strided groups at world 4)."""
    runs = [r[key] for key in ("world", "strided") for r in ranks if key in r]
    groups = {}
    for run in runs:
        groups.setdefault((run["tp_size"], run["group_id"]), []).append(run)
    return [sorted(members, key=lambda run: run["tp_rank"]) for members in groups.values()]


@functools.lru_cache(maxsize=None)
def reference(case):
    spec, inputs = CASES[case], full_inputs()
    layer = build(case, None, 0, 1)
    x = inputs[spec["x"]].clone()
    if x.is_floating_point():
        x.requires_grad_()
    y = layer(x)
    y.backward(output_grad(case))
    return {"y": y.detach(), "x_grad": x.grad, "grads": {k: p.grad for k, p in layer.named_parameters()}}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_single_device(ranks, case):
    spec, ref = CASES[case], reference(case)
    for members in tp_groups(ranks):
        runs = [m["cases"][case] for m in members]
        where = f"{case} tp={len(members)}"
        check([r["y"] for r in runs], spec["y"], ref["y"], f"{where} output")
        if ref["x_grad"] is not None:
            check([r["x_grad"] for r in runs], spec["x_layout"], ref["x_grad"], f"{where} input grad")
        for name, grad in ref["grads"].items():
            check([r["grads"][name] for r in runs], spec[name], grad, f"{where} {name} grad")
            sharded = spec[name][0] == "split"
            assert all(r["attrs"][name] == (sharded, spec[name][1] if sharded else None) for r in runs), name


def test_layers_without_group_are_plain_torch():
    inputs = full_inputs()
    column = make_layer("column_gated", None)
    torch.testing.assert_close(column(inputs["x_h"]), F.linear(inputs["x_h"], master_weight("column_gated")),
                               rtol=0, atol=0)
    embedding = make_layer("embedding", None)
    torch.testing.assert_close(embedding(inputs["ids"]), F.embedding(inputs["ids"], master_weight("embedding")),
                               rtol=0, atol=0)
    assert torch.equal(tp.init_master_weight((3, 5), 1.0, 7, torch.bfloat16),
                       tp.init_master_weight((3, 5), 1.0, 7, torch.float32).bfloat16())


def test_vocab_parallel_cross_entropy(ranks):
    inputs = full_inputs()
    logits = inputs["logits"].clone().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, V), inputs["ids"].reshape(-1), reduction="none").reshape(S, B)
    loss.backward(inputs["loss_grad"])
    for members in tp_groups(ranks):
        runs = [m["cross_entropy"] for m in members]
        check([r["loss"] for r in runs], FULL, loss.detach(), "loss")
        check([r["grad"] for r in runs], split(-1), logits.grad, "logits grad")
        assert all(r["rejected"] == [V, -1] for r in runs)
        assert all(m.get("embedding_rejects_out_of_range") for m in members)


def test_cross_entropy_single_device_dtypes_and_errors():
    inputs = full_inputs()
    logits = inputs["logits"].bfloat16().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(logits, inputs["ids"], None)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.float().reshape(-1, V), inputs["ids"].reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), expected, **TOL)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="targets"):
        tp.vocab_parallel_cross_entropy(inputs["logits"], torch.full((S, B), V), None)


def test_mappings_forward_backward_pairs(ranks):
    runs = [r["mappings"] for r in ranks]
    n = len(runs)

    def each(name, key):
        return [run[name][key] for run in runs]

    def chunk(tensor, dim, rank):
        return tensor.chunk(n, dim)[rank]

    for r in range(n):
        expected = {  # name -> (forward output, input grad) on rank r
            "copy": (each("copy", "x")[r], sum(each("copy", "gy"))),
            "reduce": (sum(each("reduce", "x")), each("reduce", "gy")[r]),
            "scatter_tp": (chunk(each("scatter_tp", "x")[r], -1, r), torch.cat(each("scatter_tp", "gy"), -1)),
            "gather_tp": (torch.cat(each("gather_tp", "x"), -1), chunk(each("gather_tp", "gy")[r], -1, r)),
            "scatter_sp": (chunk(each("scatter_sp", "x")[r], 0, r), torch.cat(each("scatter_sp", "gy"), 0)),
            "gather_sp": (torch.cat(each("gather_sp", "x"), 0), chunk(sum(each("gather_sp", "gy")), 0, r)),
            "gather_sp_split": (torch.cat(each("gather_sp_split", "x"), 0),
                                chunk(each("gather_sp_split", "gy")[r], 0, r)),
            "reduce_scatter_sp": (chunk(sum(each("reduce_scatter_sp", "x")), 0, r),
                                  torch.cat(each("reduce_scatter_sp", "gy"), 0)),
        }
        for name, (y, x_grad) in expected.items():
            torch.testing.assert_close(runs[r][name]["y"], y, **TOL, msg=f"{name} forward, rank {r}")
            torch.testing.assert_close(runs[r][name]["x_grad"], x_grad, **TOL, msg=f"{name} backward, rank {r}")
        helpers, xs = runs[r]["helpers"], [run["helpers"]["x"] for run in runs]
        for kind in ("list", "fused"):
            torch.testing.assert_close(helpers[f"gather_{kind}"], torch.cat(xs, 1), **TOL)
            torch.testing.assert_close(helpers[f"rs_{kind}"], chunk(sum(xs), 1, r), **TOL)


GLOBAL_SHAPES = {"column.weight": (FFN, H), "column.bias": (FFN,), "column_gated.weight": (2, FFN, H),
                 "column_gated.bias": (2, FFN), "row.weight": (H, FFN), "row.bias": (H,), "embedding.weight": (V, H)}


def test_sharded_state_dict_assembles_master_weights(ranks):
    """Checkpoint tensors have tp-independent global shapes and reassemble the master weights exactly."""
    for members in tp_groups(ranks):
        for case in ("column", "column_gated", "row", "embedding"):
            entries = [m["cases"][case]["sharded"] for m in members]
            for key in entries[0]:
                global_shape = GLOBAL_SHAPES[key]
                canvas, writes = torch.zeros(global_shape), torch.zeros(global_shape)
                for data, shape, offset, replica_id in (e[key] for e in entries):
                    assert shape == global_shape
                    if replica_id == 0:
                        index = tuple(slice(o, o + s) for o, s in zip(offset, data.shape))
                        canvas[index] += data
                        writes[index] += 1
                assert torch.all(writes == 1), f"{key}: every element written exactly once"
                expected = master_weight(case) if key.endswith("weight") else bias_values(case)
                torch.testing.assert_close(canvas, expected.reshape(global_shape), rtol=0, atol=0, msg=key)


def test_rng_tracker_forks_per_tp_rank(ranks):
    runs = [r["rng"] for r in ranks]
    for run in runs:
        assert run["restored"]
        assert torch.equal(run["outside"], run["expected_outside"]), "fork must not consume the default stream"
        assert not torch.equal(run["inside"], run["inside_again"]), "the forked stream advances between forks"
        assert torch.equal(run["outside"], runs[0]["outside"]), "outside fork all tp ranks agree"
    for a in range(len(runs)):
        for b in range(a + 1, len(runs)):
            assert not torch.equal(runs[a]["inside"], runs[b]["inside"]), f"tp ranks {a} and {b} share a mask"


def test_rng_tracker_and_divide_reject_misuse():
    tracker = tp.TensorParallelRNGTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError):
        tracker.add("b", 1)
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass
    assert tp.model_parallel_seed(5, 0) != tp.model_parallel_seed(5, 1)
    with pytest.raises(ValueError, match="num_embeddings"):
        tp.divide(10, 4, "num_embeddings")
