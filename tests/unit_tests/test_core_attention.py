"""Core attention: mask description, backend parity, visibility, validation, dispatch."""

import pytest
import torch

from megatron.core.transformer import attention_backends
from megatron.core.transformer.attention_backends import (
    core_attention,
    flex_block_mask,
    get_attention_backend,
    register_attention_backend,
    resolve_backend,
)
from megatron.core.transformer.attention_mask import AttentionMask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# (mask_type, block_size, window): one case per mask type.
MASK_CASES = [
    ("no_mask", None, None),
    ("causal", None, None),
    ("block_causal", 4, None),
    ("sliding_window", None, 5),
]
MASK_IDS = [case[0] for case in MASK_CASES]


def make_documents(seq_len: int) -> torch.Tensor:
    """Two rows of uneven packed documents, different per row (the last one may be padding)."""
    row0_lengths = [5, seq_len - 12, 7]
    row1_lengths = [seq_len - 13, 13]
    rows = []
    for lengths in (row0_lengths, row1_lengths):
        rows.append(torch.cat([torch.full((n,), doc) for doc, n in enumerate(lengths)]))
    return torch.stack(rows)


def reference_visible(mask_type, block_size, window, seq_len, documents=None, batch=2):
    """Visibility written from the definitions, element by element: [b, s, s] bool."""
    visible = torch.zeros(batch, seq_len, seq_len, dtype=torch.bool)
    for row in range(batch):
        for i in range(seq_len):
            for j in range(seq_len):
                if mask_type == "no_mask":
                    ok = True
                elif mask_type == "causal":
                    ok = j <= i
                elif mask_type == "block_causal":
                    ok = j // block_size <= i // block_size
                else:
                    ok = 0 <= i - j < window
                if documents is not None:
                    ok = ok and bool(documents[row, i] == documents[row, j])
                visible[row, i, j] = ok
    return visible


def make_mask(case, documents=None):
    mask_type, block_size, window = case
    return AttentionMask(mask_type, block_size=block_size, window=window, document_ids=documents)


def make_qkv(batch, hq, hkv, seq_len, dim, device="cpu", dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(heads):
        return torch.randn(batch, heads, seq_len, dim, generator=generator).to(device, dtype)

    return rand(hq), rand(hkv), rand(hkv)


def attention_and_grads(backend, q, k, v, mask, grad_out, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = core_attention(q, k, v, mask, backend=backend, **kwargs)
    grads = torch.autograd.grad((out.float() * grad_out).sum(), (q, k, v))
    return out.detach(), grads


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize("with_documents", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_sdpa_matches_math_with_gradients(case, heads, with_documents):
    seq_len = 24
    documents = make_documents(seq_len) if with_documents else None
    mask = make_mask(case, documents)
    q, k, v = make_qkv(2, heads[0], heads[1], seq_len, 8)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

    ref_out, ref_grads = attention_and_grads("math", q, k, v, mask, grad_out)
    out, grads = attention_and_grads("sdpa", q, k, v, mask, grad_out)

    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_documents", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_flex_matches_math_forward_cpu(case, heads, with_documents):
    # Forward only: torch's FlexAttention has no backward on CPU (gradients are covered by
    # the CUDA test below). seq_len 24 is deliberately not a multiple of flex's 128 block.
    seq_len = 24
    documents = make_documents(seq_len) if with_documents else None
    mask = make_mask(case, documents)
    q, k, v = make_qkv(2, heads[0], heads[1], seq_len, 8)
    with torch.no_grad():
        ref = core_attention(q, k, v, mask, backend="math")
        out = core_attention(q, k, v, mask, backend="flex")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu  # FlexAttention has no backward on CPU
@pytest.mark.parametrize("with_documents", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_backends_match_math_with_gradients_cuda(backend, case, heads, with_documents):
    seq_len = 32
    documents = make_documents(seq_len).cuda() if with_documents else None
    mask = make_mask(case, documents)
    q, k, v = make_qkv(2, heads[0], heads[1], seq_len, 16, device="cuda")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).cuda()

    ref_out, ref_grads = attention_and_grads("math", q, k, v, mask, grad_out)
    out, grads = attention_and_grads(backend, q, k, v, mask, grad_out)

    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2), (8, 8)], ids=["gqa", "mha"])
@pytest.mark.parametrize("backend", ["flex", "sdpa", "auto"])
@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_bf16_kernels_match_math_cuda(case, backend, heads):
    # bf16 reaches the fused kernels (cuDNN / flash for SDPA, the compiled flex kernel).
    seq_len = 256
    mask = make_mask(case, make_documents(seq_len).cuda())
    q, k, v = make_qkv(2, heads[0], heads[1], seq_len, 64, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).cuda()
    ref_out, ref_grads = attention_and_grads("math", q, k, v, mask, grad_out)
    out, grads = attention_and_grads(backend, q, k, v, mask, grad_out)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.float(), ref_grad.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [128, 256])
@pytest.mark.parametrize(
    "backend, case, with_documents",
    [
        ("sdpa", MASK_CASES[1], False),
        ("sdpa", MASK_CASES[2], True),
        ("flex", MASK_CASES[2], False),
        ("flex", MASK_CASES[2], True),
        ("auto", MASK_CASES[3], False),
    ],
    ids=["sdpa-causal", "sdpa-block_causal-packed", "flex-block_causal",
         "flex-block_causal-packed", "auto-sliding_window"],
)
def test_core_attention_inside_torch_compile_cuda(backend, case, with_documents, seq_len):
    # Layers will be compiled whole. Without documents everything must trace into one
    # graph; with documents flex builds its block mask outside the graph (a torch 2.11
    # miscompile, see attention_backends._document_block_mask), which this test guards:
    # traced into the graph, batch row 1 came out wrong.
    mask = make_mask(case, make_documents(seq_len).cuda() if with_documents else None)
    q, k, v = make_qkv(2, 8, 2, seq_len, 32, device="cuda", dtype=torch.bfloat16)
    fullgraph = not (backend == "flex" and with_documents)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: core_attention(q, k, v, mask, backend=backend), fullgraph=fullgraph
    )
    ref = core_attention(q, k, v, mask, backend="math")
    torch.testing.assert_close(compiled(q, k, v), ref, atol=2e-2, rtol=2e-2)


def test_custom_softmax_scale_matches_math():
    mask = AttentionMask("sliding_window", window=3)
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    ref = core_attention(q, k, v, mask, backend="math", softmax_scale=0.3)
    default_scale = core_attention(q, k, v, mask, backend="math")
    torch.testing.assert_close(core_attention(q, k, v, mask, backend="sdpa", softmax_scale=0.3), ref)
    with torch.no_grad():
        torch.testing.assert_close(
            core_attention(q, k, v, mask, backend="flex", softmax_scale=0.3), ref
        )
    assert not torch.allclose(ref, default_scale)


def test_output_keeps_input_dtype():
    mask = AttentionMask("causal")
    q, k, v = make_qkv(2, 4, 2, 16, 8, dtype=torch.bfloat16)
    for backend in ("math", "sdpa", "auto"):
        assert core_attention(q, k, v, mask, backend=backend).dtype == torch.bfloat16


# ---------------------------------------------------------------------------- visibility
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("with_documents", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_perturbing_position_j_changes_exactly_visible_queries(backend, case, with_documents):
    seq_len = 24
    documents = make_documents(seq_len) if with_documents else None
    mask = make_mask(case, documents)
    expected = reference_visible(*case, seq_len, documents)
    q, k, v = make_qkv(2, 4, 2, seq_len, 8)
    base = core_attention(q, k, v, mask, backend=backend)
    noise = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(3))

    for perturbed in ("key", "value"):
        changed = torch.zeros_like(expected)
        for j in range(seq_len):
            k2, v2 = k.clone(), v.clone()
            target = k2 if perturbed == "key" else v2
            target[:, :, j] += noise
            out = core_attention(q, k2, v2, mask, backend=backend)
            delta = (out - base).abs().amax(dim=(1, 3))  # [b, s]: any head, any channel
            # Invisible keys must leave the output bit-for-bit alone; visible ones move it.
            assert torch.all((delta == 0) | (delta > 1e-5)), f"ambiguous change at j={j}"
            changed[:, :, j] = delta > 0
        if perturbed == "key":
            # A query that sees a single key gives it probability 1 whatever its score.
            expected_changed = expected & (expected.sum(-1, keepdim=True) > 1)
        else:
            expected_changed = expected
        assert torch.equal(changed, expected_changed), f"{perturbed} perturbation pattern differs"


# ---------------------------------------------------------------------------- dense()
def _pattern(rows):
    return torch.tensor([[c == "1" for c in row] for row in rows])


def test_dense_block_causal_hand_pattern():
    dense = AttentionMask("block_causal", block_size=2).dense(6)
    expected = _pattern(["110000", "110000", "111100", "111100", "111111", "111111"])
    assert dense.shape == (1, 1, 6, 6) and dense.dtype == torch.bool
    assert torch.equal(dense[0, 0], expected)


def test_dense_sliding_window_hand_pattern():
    dense = AttentionMask("sliding_window", window=3).dense(6)
    expected = _pattern(["100000", "110000", "111000", "011100", "001110", "000111"])
    assert torch.equal(dense[0, 0], expected)


def test_dense_causal_and_no_mask_hand_patterns():
    assert torch.equal(AttentionMask("causal").dense(3)[0, 0], _pattern(["100", "110", "111"]))
    assert AttentionMask("no_mask").dense(3).all()


def test_dense_documents_hand_pattern():
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    dense = AttentionMask("causal", document_ids=documents).dense(6)
    assert dense.shape == (2, 1, 6, 6)
    expected_row0 = _pattern(["100000", "110000", "001000", "001100", "001110", "000001"])
    assert torch.equal(dense[0, 0], expected_row0)
    assert torch.equal(dense[1, 0], _pattern(["100000", "110000", "111000",
                                              "111100", "111110", "111111"]))
    bidirectional = AttentionMask("no_mask", document_ids=documents).dense(6)
    assert torch.equal(bidirectional[0, 0, 2], _pattern(["001110"])[0])


@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_dense_matches_reference_definition(case):
    documents = make_documents(24)
    dense = make_mask(case, documents).dense(24)
    assert torch.equal(dense[:, 0], reference_visible(*case, 24, documents))


def test_flex_block_mask_matches_dense():
    documents = make_documents(24)
    for case in MASK_CASES[1:]:
        for docs in (None, documents):
            mask = make_mask(case, docs)
            block_mask = flex_block_mask(mask, 24, "cpu")
            # to_dense() is only block-granular; the mask_mod it carries is the element rule.
            b_idx = torch.arange(2)[:, None, None]
            i_idx = torch.arange(24)[None, :, None]
            j_idx = torch.arange(24)[None, None, :]
            allowed = block_mask.mask_mod(b_idx, 0, i_idx, j_idx).expand(2, 24, 24)
            assert torch.equal(allowed, mask.dense(24).expand(2, 1, 24, 24)[:, 0])


def test_flex_block_mask_cached_without_documents_only():
    mask = AttentionMask("block_causal", block_size=4)
    same = AttentionMask("block_causal", block_size=4)
    assert flex_block_mask(mask, 16, "cpu") is flex_block_mask(same, 16, "cpu")
    assert flex_block_mask(mask, 16, "cpu") is not flex_block_mask(mask, 32, "cpu")
    packed = AttentionMask("block_causal", block_size=4, document_ids=make_documents(24))
    assert flex_block_mask(packed, 24, "cpu") is not flex_block_mask(packed, 24, "cpu")
    assert flex_block_mask(AttentionMask("no_mask"), 16, "cpu") is None


def test_mask_equality_and_hash():
    documents = make_documents(24)
    assert AttentionMask("causal") == AttentionMask("causal", block_size=7)
    assert AttentionMask("block_causal", block_size=2) != AttentionMask("block_causal", block_size=4)
    packed = AttentionMask("causal", document_ids=documents)
    assert packed == AttentionMask("causal", document_ids=documents.clone())
    assert packed != AttentionMask("causal", document_ids=documents.flip(0))
    assert packed != AttentionMask("causal")
    assert hash(packed) == hash(AttentionMask("causal", document_ids=documents.clone()))


def test_mask_properties():
    """The two patterns SDPA runs without a mask tensor: plain causal (`is_causal`) and none at all
    (`is_full`); packed documents or a window make either one a dense pattern."""
    documents = make_documents(24)
    assert AttentionMask("causal").is_causal and not AttentionMask("causal").is_full
    assert not AttentionMask("causal", document_ids=documents).is_causal
    assert AttentionMask("no_mask").is_full and not AttentionMask("no_mask").is_causal
    assert not AttentionMask("no_mask", document_ids=documents).is_full
    window = AttentionMask("sliding_window", window=2)
    assert not (window.is_full or window.is_causal)


# ---------------------------------------------------------------------------- validation
def test_block_size_must_divide_sequence():
    mask = AttentionMask("block_causal", block_size=5)
    with pytest.raises(ValueError, match="block_size"):
        mask.validate(16)
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="block_size"):
        core_attention(q, k, v, mask, backend="math")


def test_missing_or_bad_structure_parameters():
    with pytest.raises(ValueError, match="block_size"):
        AttentionMask("block_causal")
    with pytest.raises(ValueError, match="window"):
        AttentionMask("sliding_window")
    with pytest.raises(ValueError, match="window"):
        AttentionMask("sliding_window", window=0)
    with pytest.raises(ValueError, match="mask_type"):
        AttentionMask("causal_bottom_right")


def test_document_ids_shape_and_dtype():
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    wrong_length = AttentionMask("causal", document_ids=torch.zeros(2, 15, dtype=torch.long))
    with pytest.raises(ValueError, match="document_ids"):
        wrong_length.validate(16)
    with pytest.raises(ValueError, match="document_ids"):
        core_attention(q, k, v, wrong_length, backend="sdpa")
    wrong_batch = AttentionMask("causal", document_ids=torch.zeros(3, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="document_ids"):
        core_attention(q, k, v, wrong_batch, backend="sdpa")
    one_dim = AttentionMask("causal", document_ids=torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="document_ids"):
        one_dim.validate(16)
    floats = AttentionMask("causal", document_ids=torch.zeros(2, 16))
    with pytest.raises(ValueError, match="document_ids"):
        floats.validate(16)


def test_input_shape_errors():
    mask = AttentionMask("no_mask")
    q, k, v = make_qkv(2, 4, 3, 16, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        core_attention(q, k, v, mask)
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="4-D"):
        core_attention(q[0], k, v, mask)
    with pytest.raises(ValueError, match="same shape"):
        core_attention(q, k, v[..., :4], mask)


def test_unknown_backend_lists_registered_names():
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="registered backends: .*flex.*math.*sdpa"):
        core_attention(q, k, v, AttentionMask("causal"), backend="te")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


def test_flex_rejects_dropout():
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="flex does not support attention dropout"):
        core_attention(q, k, v, AttentionMask("causal"), backend="flex", dropout_p=0.1)


def test_flex_backward_on_cpu_gives_clear_error():
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="no backward on CPU"):
        core_attention(q, k, v, AttentionMask("causal"), backend="flex")


# ---------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_is_applied_and_seeded(backend):
    q, k, v = make_qkv(2, 4, 2, 16, 8)
    mask = AttentionMask("causal")
    clean = core_attention(q, k, v, mask, backend=backend)
    torch.manual_seed(0)
    first = core_attention(q, k, v, mask, backend=backend, dropout_p=0.5)
    torch.manual_seed(0)
    second = core_attention(q, k, v, mask, backend=backend, dropout_p=0.5)
    assert not torch.allclose(first, clean)
    torch.testing.assert_close(first, second)


# ---------------------------------------------------------------------------- dispatch
def test_resolve_backend_on_cpu_is_sdpa():
    documents = make_documents(24)
    for case in MASK_CASES:
        for docs in (None, documents):
            assert resolve_backend("auto", make_mask(case, docs), torch.device("cpu")) == "sdpa"
    assert resolve_backend("flex", AttentionMask("causal"), "cpu") == "flex"


def test_resolve_backend_on_cuda():
    cuda = torch.device("cuda")  # only the device type is read: no GPU needed
    documents = make_documents(24)
    assert resolve_backend("auto", AttentionMask("no_mask"), cuda) == "sdpa"
    assert resolve_backend("auto", AttentionMask("causal"), cuda) == "sdpa"
    assert resolve_backend("auto", AttentionMask("causal", document_ids=documents), cuda) == "flex"
    assert resolve_backend("auto", AttentionMask("no_mask", document_ids=documents), "cuda:1") == "flex"
    assert resolve_backend("auto", AttentionMask("block_causal", block_size=4), cuda) == "flex"
    assert resolve_backend("auto", AttentionMask("sliding_window", window=8), cuda) == "flex"
    assert resolve_backend("auto", AttentionMask("block_causal", block_size=4), cuda, 0.1) == "sdpa"
    assert resolve_backend("math", AttentionMask("block_causal", block_size=4), cuda) == "math"
    with pytest.raises(ValueError, match="registered backends"):
        resolve_backend("nope", AttentionMask("causal"), cuda)


def test_registered_backend_is_used(monkeypatch):
    calls = []

    def recording_backend(q, k, v, mask, softmax_scale, dropout_p):
        calls.append((mask.mask_type, softmax_scale, dropout_p))
        return torch.zeros_like(q, dtype=torch.float32)

    # setitem first only so that monkeypatch removes the name again after the test.
    monkeypatch.setitem(attention_backends._BACKENDS, "recording", None)
    register_attention_backend("recording", recording_backend)
    q, k, v = make_qkv(2, 4, 2, 16, 8, dtype=torch.bfloat16)
    out = core_attention(q, k, v, AttentionMask("causal"), backend="recording", dropout_p=0.2)
    assert calls == [("causal", pytest.approx(8 ** -0.5), 0.2)]
    assert out.dtype == torch.bfloat16  # cast back to q's dtype by the interface
    with pytest.raises(ValueError, match="reserved"):
        register_attention_backend("auto", recording_backend)


# ---------------------------------------------------------------------------- query / key positions
def load_balanced_positions(seq_len: int, ranks: int, rank: int) -> torch.Tensor:
    """Chunks rank and 2C-1-rank of 2C: what causal context parallelism gives a rank."""
    chunk = seq_len // (2 * ranks)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * ranks - 1 - rank) * chunk, (2 * ranks - rank) * chunk)])


@pytest.mark.parametrize("with_documents", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_mask_at_positions_is_the_full_mask_at_those_rows_and_columns(case, with_documents):
    """A rank holding some queries (and keys) sees exactly the full mask's rows and columns at
    their global positions: every rule and the documents are read at the true positions."""
    documents = make_documents(24) if with_documents else None
    full = make_mask(case, documents).dense(24)
    queries = load_balanced_positions(24, 3, 1)
    keys = torch.tensor([0, 3, 4, 9, 12, 17, 20, 23])
    mask_type, block_size, window = case
    mask = AttentionMask(mask_type, block_size=block_size, window=window, document_ids=documents,
                         query_positions=queries, key_positions=keys)
    assert not mask.is_causal
    expected = full[:, :, queries][:, :, :, keys]
    assert torch.equal(mask.dense(len(queries), key_len=len(keys)).expand_as(expected), expected)
    if mask_type != "no_mask" or with_documents:
        block_mask = flex_block_mask(mask, len(queries), "cpu", len(keys))
        b_idx, i_idx, j_idx = torch.arange(2)[:, None, None], torch.arange(8)[None, :, None], torch.arange(8)
        allowed = block_mask.mask_mod(b_idx, 0, i_idx, j_idx[None, None, :]).expand(2, 8, 8)
        assert torch.equal(allowed, expected.expand(2, 1, 8, 8)[:, 0])


# flex has no backward on CPU
@pytest.mark.parametrize("backend", ["math", "sdpa", pytest.param("flex", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", MASK_CASES, ids=MASK_IDS)
def test_attention_of_query_chunks_against_all_keys_equals_the_full_rows(backend, case):
    """Context parallelism's contract: each rank's load-balanced query chunks against every key,
    with positions, give exactly those rows of the one-rank attention, forward and backward."""
    device = "cuda" if backend == "flex" else "cpu"
    q, k, v = (t.to(device) for t in make_qkv(2, 4, 2, 24, 16))  # flex's kernel needs head dim >= 16
    documents = make_documents(24).to(device)
    grad_out = torch.randn(2, 4, 24, 16, generator=torch.Generator().manual_seed(3)).to(device)
    full_out, (full_dq, full_dk, full_dv) = attention_and_grads("math", q, k, v, make_mask(case, documents), grad_out)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    mask_type, block_size, window = case
    for rank in range(2):
        rows = load_balanced_positions(24, 2, rank).to(device)
        mask = AttentionMask(mask_type, block_size=block_size, window=window, document_ids=documents,
                             query_positions=rows)
        out, (dq, dk_part, dv_part) = attention_and_grads(backend, q[:, :, rows], k, v, mask,
                                                          grad_out[:, :, rows])
        torch.testing.assert_close(out, full_out[:, :, rows])
        torch.testing.assert_close(dq, full_dq[:, :, rows])
        dk, dv = dk + dk_part, dv + dv_part  # the reduce-scatter of dK/dV, summed here
    torch.testing.assert_close(dk, full_dk)
    torch.testing.assert_close(dv, full_dv)


def test_positions_are_checked():
    with pytest.raises(ValueError, match=r"query_positions must be a \[4\] integer tensor"):
        AttentionMask("causal", query_positions=torch.arange(3)).validate(4)
    with pytest.raises(ValueError, match="need an explicit mask"):
        AttentionMask("causal").validate(4, key_len=8)
    with pytest.raises(ValueError, match=r"document_ids has shape \(1, 4\), expected \[b, >= 8\]"):
        AttentionMask("no_mask", document_ids=torch.zeros(1, 4, dtype=torch.long),
                      query_positions=torch.arange(4)).validate(4, key_len=8)
    with pytest.raises(ValueError, match="takes no document_ids or positions"):
        AttentionMask("explicit", allowed=torch.ones(1, 2, 2, dtype=torch.bool), query_positions=torch.arange(2))
    with_positions = AttentionMask("causal", query_positions=torch.arange(4))
    assert with_positions != AttentionMask("causal") and with_positions == AttentionMask(
        "causal", query_positions=torch.arange(4))
