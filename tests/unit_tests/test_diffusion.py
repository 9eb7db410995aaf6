"""Tests of the masked-diffusion forward process (megatron/core/models/difflm/diffusion.py).

Statistical checks use fixed seeds, so they are deterministic; their bounds are stated as
multiples of the standard deviation the check would have under an ideal generator.
"""

import math

import pytest
import torch

from megatron.core.models.difflm.diffusion import (
    Corruption, CorruptionKey, corrupt, keyed_bits, keyed_uniform, loss_weights,
    mask_probability, sample_t, varilen_length)
from megatron.core.transformer.transformer_config import DLMConfig

MASK = 1000


def cfg_(**kw) -> DLMConfig:
    kw.setdefault("mask_token_id", MASK)
    return DLMConfig(**kw)


# ---------------------------------------------------------------- reference hash (python big ints)

def _ref_mix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x7FEB352D) % 2 ** 32
    h ^= h >> 15
    h = (h * 0x846CA68B) % 2 ** 32
    return h ^ (h >> 16)


def _ref_hash(seed: int, stream: int, *indices: int) -> int:
    """The documented construction, written independently: words = seed (lo, hi), stream (lo, hi),
    number of indices, then each index (lo, hi) of its 64-bit two's complement; h <- mix(h ^ w)."""
    words = []
    for value in (seed, stream):
        value %= 2 ** 64
        words += [value % 2 ** 32, value // 2 ** 32]
    words.append(len(indices))
    for value in indices:
        value %= 2 ** 64
        words += [value % 2 ** 32, value // 2 ** 32]
    h = 0x243F6A88
    for w in words:
        h = _ref_mix(h ^ w)
    return h


def test_hash_matches_bigint_reference_incl_huge_indices():
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 2 ** 20, (100,), generator=gen, dtype=torch.int64)
    near40 = 2 ** 40 + torch.arange(-50, 50, dtype=torch.int64)
    huge = torch.tensor([2 ** 63 - 1, -(2 ** 63), -1, -12345, 2 ** 32 - 1, 2 ** 32, 2 ** 62 + 7], dtype=torch.int64)
    first = torch.cat([a, near40, huge])
    second = torch.cat([torch.arange(100), torch.arange(100) * 97 + 2 ** 33, torch.arange(7)])
    for seed, stream in [(1234, 0), (2 ** 40 + 3, 1), (-7, 5)]:
        got = keyed_bits(seed, stream, 3, first, second)
        want = [_ref_hash(seed, stream, 3, int(x), int(y)) for x, y in zip(first, second)]
        assert got.tolist() == want
        assert int(got.min()) >= 0 and int(got.max()) < 2 ** 32
        u = keyed_uniform(seed, stream, 3, first, second)
        assert u.dtype == torch.float32
        assert u.tolist() == [(w >> 8) / 2 ** 24 for w in want]
    # python-int path gives the same as the tensor path
    assert keyed_bits(9, 2, 5, 2 ** 40) == _ref_hash(9, 2, 5, 2 ** 40)


def test_keyed_uniform_deterministic_and_sensitive():
    idx = torch.arange(4096)
    base = keyed_uniform(1, 0, idx)
    assert torch.equal(base, keyed_uniform(1, 0, idx))
    for other in (keyed_uniform(2, 0, idx), keyed_uniform(1, 1, idx), keyed_uniform(1, 0, idx + 1),
                  keyed_uniform(1, 0, idx, torch.zeros_like(idx))):
        # an independent stream agrees with `base` only by collision of 24-bit values
        assert (other == base).float().mean() < 0.01
    assert keyed_uniform(1, 0, torch.tensor(0)).item() != keyed_uniform(1, 0, torch.tensor(1)).item()


def test_keyed_uniform_moments_and_histogram():
    rows = torch.arange(1000)[:, None]
    cols = torch.arange(1000)[None, :]
    u = keyed_uniform(1234, 0, 1, rows, cols).flatten().double()
    n = u.numel()
    assert n == 10 ** 6
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # mean: sd = sqrt(1/12/n) = 2.9e-4; bound 5 sd
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    # variance: sd of the sample variance = sqrt((1/80 - 1/144)/n) = 7.5e-5; bound 5 sd
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    # chi-square over 100 bins (99 dof, sd ~ 14): below 99 + 5 * 14
    counts = torch.bincount((u * 100).long(), minlength=100).double()
    chi2 = float(((counts - n / 100) ** 2 / (n / 100)).sum())
    assert chi2 < 99 + 5 * math.sqrt(2 * 99)
    # neighbouring positions are uncorrelated: sd of the correlation ~ 1/sqrt(n)
    grid = u.view(1000, 1000)
    corr = torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1]
    assert abs(float(corr)) < 5 / math.sqrt(n)


def test_keyed_bits_rejects_float_index():
    with pytest.raises(ValueError, match="indices"):
        keyed_bits(1, 0, torch.ones(3))


# ---------------------------------------------------------------- masks

@pytest.mark.parametrize("t_value", [0.0, 0.05, 0.5, 0.9, 0.999])
def test_masked_fraction_tracks_p(t_value):
    cfg = cfg_(eps=1e-3)
    rows, seq = 32, 4096
    key = CorruptionKey.for_batch(7, 0, rows, 10_000, rows)
    c = corrupt(torch.zeros(rows, seq, dtype=torch.long), cfg, key, t=torch.full((rows,), t_value))
    p = (1 - 1e-3) * t_value + 1e-3
    assert torch.allclose(c.p_mask, torch.full_like(c.p_mask, p))
    n = rows * seq
    frac = c.masked_positions.double().mean().item()
    assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 binomial sd
    assert torch.equal(c.noisy_input_ids == MASK, c.masked_positions)


def test_sampled_t_gives_matching_masked_fraction_per_row():
    cfg = cfg_()
    rows, seq = 64, 4096
    key = CorruptionKey.for_batch(3, 5, rows, 0, rows)
    c = corrupt(torch.zeros(rows, seq, dtype=torch.long), cfg, key)
    p = mask_probability(cfg, sample_t(cfg, key))
    frac = c.masked_positions.double().mean(dim=1)
    sd = torch.sqrt(p * (1 - p) / seq)
    assert bool(((frac - p).abs() <= 5 * sd + 1e-12).all())


def test_same_key_same_mask_and_sample_index_changes_it():
    cfg = cfg_()
    x = torch.randint(0, 100, (8, 256), generator=torch.Generator().manual_seed(1))
    key = CorruptionKey.for_batch(11, 3, 8, 500, 8)
    a, b = corrupt(x, cfg, key), corrupt(x.clone(), cfg, key)
    assert torch.equal(a.masked_positions, b.masked_positions)
    assert torch.equal(a.noisy_input_ids, b.noisy_input_ids)
    shifted = corrupt(x, cfg, CorruptionKey.for_batch(11, 3, 8, 501, 8))
    assert not torch.equal(a.masked_positions, shifted.masked_positions)
    other_seed = corrupt(x, cfg, CorruptionKey.for_batch(12, 3, 8, 500, 8))
    assert not torch.equal(a.masked_positions, other_seed.masked_positions)
    evaluation = corrupt(x, cfg, CorruptionKey.for_batch(11, 3, 8, 500, 8, stream=1))
    assert not torch.equal(a.masked_positions, evaluation.masked_positions)


@pytest.mark.parametrize("t_sampling,per_doc", [("uniform", False), ("antithetic", False), ("uniform", True)])
def test_row_mask_independent_of_batch_split(t_sampling, per_doc):
    """DP=2 (two halves with their own keys) equals one process holding the whole batch."""
    cfg = cfg_(t_sampling=t_sampling, per_document_t=per_doc, loss_weight="inverse_empirical")
    x = torch.randint(0, 100, (8, 128), generator=torch.Generator().manual_seed(2))
    maskable = torch.ones_like(x, dtype=torch.bool)
    maskable[:, -5:] = False
    docs = (torch.arange(128) // 40).expand(8, 128)
    full = corrupt(x, cfg, CorruptionKey.for_batch(5, 9, 8, 64, 8), maskable, docs)
    for start in (0, 4):
        key = CorruptionKey.for_batch(5, 9, 8, 64 + start, 4, first_batch_position=start)
        part = corrupt(x[start:start + 4], cfg, key, maskable[start:start + 4], docs[start:start + 4])
        assert torch.equal(part.masked_positions, full.masked_positions[start:start + 4])
        assert torch.equal(part.p_mask, full.p_mask[start:start + 4])
        narrowed = corrupt(x[start:start + 4], cfg, CorruptionKey.for_batch(5, 9, 8, 64, 8).narrow(start, 4),
                           maskable[start:start + 4], docs[start:start + 4])
        assert torch.equal(narrowed.masked_positions, part.masked_positions)


def test_per_document_t_differs_between_documents():
    cfg = cfg_(per_document_t=True)
    docs = torch.tensor([[0] * 10 + [1] * 10 + [2] * 12])
    c = corrupt(torch.zeros(1, 32, dtype=torch.long), cfg, CorruptionKey.for_batch(1, 0, 1, 0, 1), document_ids=docs)
    p = c.p_mask[0]
    assert len({p[0].item(), p[10].item(), p[20].item()}) == 3
    for lo, hi in ((0, 10), (10, 20), (20, 32)):
        assert bool((p[lo:hi] == p[lo]).all())
    per_row = corrupt(torch.zeros(1, 32, dtype=torch.long), cfg_(), CorruptionKey.for_batch(1, 0, 1, 0, 1))
    assert bool((per_row.p_mask == per_row.p_mask[0, 0]).all())


def test_unmaskable_positions_never_masked_nor_counted():
    cfg = cfg_(eps=0.5)  # p >= 0.5 so many tokens are masked
    rows, seq = 16, 64
    maskable = torch.ones(rows, seq, dtype=torch.bool)
    maskable[:, :8] = False                  # prompt
    maskable[::2, 50:] = False               # padding on even rows
    x = torch.arange(rows * seq).view(rows, seq) % 97
    c = corrupt(x, cfg, CorruptionKey.for_batch(1, 0, rows, 0, rows), maskable, t=torch.full((rows,), 0.99))
    assert not bool(c.masked_positions[~maskable].any())
    assert torch.equal(c.noisy_input_ids[~maskable], x[~maskable])
    assert bool(c.masked_positions.any())
    for normalizer, expected in (("tokens", int(maskable.sum())), ("sequence", rows),
                                 ("masked", int(c.masked_positions.sum()))):
        _, norm = loss_weights(c, cfg_(loss_normalizer=normalizer))
        assert norm.item() == expected
    assert int(maskable.sum()) == rows * seq - rows * 8 - (rows // 2) * 14


@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_antithetic_t_one_per_stratum(n):
    cfg = cfg_(t_sampling="antithetic", eps=1e-3)
    for iteration in (0, 1, 17):
        t = sample_t(cfg, CorruptionKey.for_batch(3, iteration, n, 12345, n))
        assert t.dtype == torch.float64 and t.shape == (n,)
        strata = sorted(t.tolist())
        for k, value in enumerate(strata):
            assert k / n <= value < (k + 1) / n
        p = mask_probability(cfg, t)
        assert bool((p >= 1e-3).all()) and bool((p <= 1.0).all())
        # exact construction: t_i = N_i / D with integer N_i = (N_0 + i * 2**24) mod D, D = n * 2**24
        denom = n * 2 ** 24
        numer = [round(value * denom) for value in t.tolist()]
        assert all(value == num / denom for value, num in zip(t.tolist(), numer))
        assert len({(num - i * 2 ** 24) % denom for i, num in enumerate(numer)}) == 1
    t0 = sample_t(cfg, CorruptionKey.for_batch(3, 0, n, 0, n))
    t1 = sample_t(cfg, CorruptionKey.for_batch(3, 1, n, 0, n))
    assert not torch.equal(t0, t1)
    # keyed by batch position and iteration, not by sample index
    assert torch.equal(t0, sample_t(cfg, CorruptionKey.for_batch(3, 0, n, 999, n)))


def test_uniform_t_in_range_and_roughly_uniform():
    cfg = cfg_()
    t = sample_t(cfg, CorruptionKey.for_batch(3, 0, 20000, 0, 20000))
    assert float(t.min()) >= 0 and float(t.max()) < 1
    assert abs(float(t.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / 20000)


# ---------------------------------------------------------------- loss weights

def _hand_batch():
    """3 rows x 4 positions; row 1 has one padding token, row 2 is all padding."""
    maskable = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    masked = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    p = torch.tensor([[0.5] * 4, [0.25] * 4, [0.8] * 4])
    ce = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 1.5, 2.5, 9.0], [100.0, 100.0, 100.0, 100.0]])
    ids = torch.where(masked, torch.tensor(MASK), torch.tensor(5))
    return Corruption(ids, masked, p, maskable), ce


# Worked by hand from _hand_batch. Masked CE: row 0 -> 1, 3 (p 0.5); row 1 -> 1.5 (p 0.25).
# maskable: row 0 has 4, row 1 has 3, row 2 none -> 7 tokens, 3 masked, 2 rows.
#  inverse_p:          sum = 1*2 + 3*2 + 1.5*4 = 14;   per row 8 | 6
#  inverse_empirical:  w = 4/2 | 3/1; sum = 8 + 4.5 = 12.5; per row 8 | 4.5
#  none:               sum = 5.5; per row 4 | 1.5
#  sequence: (row0 / 4 + row1 / 3) / 2
EXPECTED = {
    ("inverse_p", "tokens"): 14 / 7, ("inverse_p", "masked"): 14 / 3, ("inverse_p", "sequence"): (2 + 2) / 2,
    ("inverse_empirical", "tokens"): 12.5 / 7, ("inverse_empirical", "masked"): 12.5 / 3,
    ("inverse_empirical", "sequence"): (2 + 1.5) / 2,
    ("none", "tokens"): 5.5 / 7, ("none", "masked"): 5.5 / 3, ("none", "sequence"): (1 + 0.5) / 2,
}


@pytest.mark.parametrize("weight,normalizer", sorted(EXPECTED))
def test_loss_weights_hand_computed(weight, normalizer):
    corruption, ce = _hand_batch()
    cfg = cfg_(loss_weight=weight, loss_normalizer=normalizer)
    w, norm = loss_weights(corruption, cfg)
    assert w.dtype == torch.float32 and w.shape == ce.shape and norm.dim() == 0
    assert not bool(w[~corruption.masked_positions].any())
    assert abs(((ce * w).sum() / norm).item() - EXPECTED[(weight, normalizer)]) < 1e-6
    # passing maskable explicitly is the same as the one stored by corrupt
    w2, norm2 = loss_weights(Corruption(*(corruption.noisy_input_ids, corruption.masked_positions,
                                          corruption.p_mask)), cfg, corruption.maskable)
    assert torch.equal(w, w2) and torch.equal(norm, norm2)


def test_llada_setting_explicit():
    """LLaDA pretraining: p = (1 - eps) t + eps, eps 1e-3, weight 1/p, divide by B * L."""
    cfg = cfg_(eps=1e-3, loss_weight="inverse_p", loss_normalizer="tokens")
    bsz, seq = 2, 64
    t = torch.tensor([0.3, 0.7])
    c = corrupt(torch.zeros(bsz, seq, dtype=torch.long), cfg, CorruptionKey.for_batch(1, 0, bsz, 0, bsz), t=t)
    ce = torch.linspace(0.1, 6.4, bsz * seq).view(bsz, seq)
    w, norm = loss_weights(c, cfg)
    p_rows = [0.999 * 0.3 + 0.001, 0.999 * 0.7 + 0.001]
    expected = sum(ce[b, i].item() / p_rows[b] for b in range(bsz) for i in range(seq)
                   if c.masked_positions[b, i]) / (bsz * seq)
    assert norm.item() == bsz * seq
    assert abs(((ce * w).sum() / norm).item() - expected) < 1e-6 * max(1.0, expected)


def test_sums_over_microbatches_equal_one_batch():
    cfg = cfg_(loss_weight="inverse_p", loss_normalizer="sequence")
    x = torch.zeros(8, 32, dtype=torch.long)
    ce = torch.rand(8, 32, generator=torch.Generator().manual_seed(4))
    w, n = loss_weights(corrupt(x, cfg, CorruptionKey.for_batch(1, 0, 8, 0, 8)), cfg, clamp_normalizer=False)
    total_sum, total_n = 0.0, 0.0
    for start in (0, 2, 4, 6):
        key = CorruptionKey.for_batch(1, 0, 8, start, 2, first_batch_position=start)
        wi, ni = loss_weights(corrupt(x[start:start + 2], cfg, key), cfg, clamp_normalizer=False)
        total_sum += (ce[start:start + 2] * wi).sum().item()
        total_n += ni.item()
    assert total_n == n.item()
    assert abs(total_sum / total_n - ((ce * w).sum() / n).item()) < 1e-6


def test_empty_batch_normalizer_clamped():
    cfg = cfg_(loss_normalizer="masked")
    c = corrupt(torch.zeros(2, 8, dtype=torch.long), cfg, CorruptionKey.for_batch(1, 0, 2, 0, 2),
                torch.zeros(2, 8, dtype=torch.bool))
    w, n = loss_weights(c, cfg)
    assert n.item() == 1.0 and not bool(w.any())
    assert loss_weights(c, cfg, clamp_normalizer=False)[1].item() == 0.0


def test_inverse_empirical_forces_one_mask():
    rows, seq = 16, 32
    maskable = torch.ones(rows, seq, dtype=torch.bool)
    maskable[:, :4] = False
    maskable[-1] = False                     # nothing maskable: stays unmasked
    x = torch.zeros(rows, seq, dtype=torch.long)
    key = CorruptionKey.for_batch(1, 0, rows, 0, rows)
    tiny = torch.zeros(rows)
    plain = corrupt(x, cfg_(eps=1e-6, loss_weight="inverse_p"), key, maskable, t=tiny)
    assert int(plain.masked_positions.sum()) == 0   # p = 1e-6: nothing drawn
    cfg = cfg_(eps=1e-6, loss_weight="inverse_empirical")
    forced = corrupt(x, cfg, key, maskable, t=tiny)
    counts = forced.masked_positions.sum(dim=1)
    assert counts[:-1].tolist() == [1] * (rows - 1) and counts[-1].item() == 0
    assert not bool(forced.masked_positions[~maskable].any())
    assert torch.equal(forced.masked_positions, corrupt(x, cfg, key, maskable, t=tiny).masked_positions)
    # the chosen position varies between rows (it is hashed, not always the first maskable one)
    assert len(set(forced.masked_positions[:-1].float().argmax(dim=1).tolist())) > 3
    w, _ = loss_weights(forced, cfg)
    assert torch.allclose(w.sum(dim=1)[:-1], torch.full((rows - 1,), float(seq - 4)))
    # rows that drew masks are not touched
    normal = corrupt(x, cfg, key, maskable, t=torch.full((rows,), 0.5))
    assert torch.equal(normal.masked_positions,
                       corrupt(x, cfg_(eps=1e-6, loss_weight="inverse_p"), key, maskable,
                               t=torch.full((rows,), 0.5)).masked_positions)


# ---------------------------------------------------------------- variable length

def test_varilen_frequency_range_and_determinism():
    cfg = cfg_(varilen_prob=0.25, seed=77)
    seq, mult, n = 100, 8, 4000
    lengths = [varilen_length(cfg, it, mb, seq, mult) for it in range(1000) for mb in range(4)]
    truncated = [length for length in lengths if length != seq]
    # floor to a multiple of 8 puts every drawn length below 100, so every coin shows
    freq = len(truncated) / n
    assert abs(freq - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)
    assert all(mult <= length <= seq - seq % mult and length % mult == 0 for length in truncated)
    assert min(truncated) == mult and max(truncated) == 96
    assert lengths == [varilen_length(cfg, it, mb, seq, mult) for it in range(1000) for mb in range(4)]
    ones = [varilen_length(cfg_(varilen_prob=1.0), it, 0, 50) for it in range(2000)]
    assert all(1 <= length <= 50 for length in ones) and min(ones) == 1 and max(ones) == 50
    assert abs(sum(ones) / len(ones) - 25.5) < 5 * math.sqrt((50 ** 2 - 1) / 12 / 2000)
    assert all(varilen_length(cfg_(varilen_prob=0.0), it, mb, seq, mult) == seq
               for it in range(500) for mb in range(4))
    # a different seed gives different decisions
    assert lengths != [varilen_length(cfg_(varilen_prob=0.25, seed=78), it, mb, seq, mult)
                       for it in range(1000) for mb in range(4)]


# ---------------------------------------------------------------- validation

def test_bad_inputs_name_the_argument():
    cfg = cfg_()
    key = CorruptionKey.for_batch(1, 0, 2, 0, 2)
    x = torch.zeros(2, 8, dtype=torch.long)
    cases = [
        ("input_ids", lambda: corrupt(x.float(), cfg, key)),
        ("input_ids", lambda: corrupt(x[0], cfg, key)),
        ("maskable", lambda: corrupt(x, cfg, key, torch.ones(2, 7, dtype=torch.bool))),
        ("maskable", lambda: corrupt(x, cfg, key, torch.ones(2, 8))),
        ("document_ids", lambda: corrupt(x, cfg, key, None, torch.zeros(2, 9, dtype=torch.long))),
        ("document_ids", lambda: corrupt(x, cfg, key, None, torch.zeros(2, 8))),
        ("key", lambda: corrupt(x, cfg, CorruptionKey.for_batch(1, 0, 3, 0, 3))),
        ("t", lambda: corrupt(x, cfg, key, t=torch.zeros(3))),
        ("mask_token_id", lambda: corrupt(x, DLMConfig(), key)),
        ("sample_index", lambda: CorruptionKey(1, torch.zeros(2), torch.zeros(2, dtype=torch.long), 2, 0)),
        ("batch_position", lambda: CorruptionKey(1, torch.zeros(2, dtype=torch.long),
                                                 torch.zeros(3, dtype=torch.long), 2, 0)),
        ("global_batch_size", lambda: CorruptionKey(1, torch.zeros(2, dtype=torch.long),
                                                    torch.zeros(2, dtype=torch.long), 0, 0)),
        ("batch_position", lambda: CorruptionKey.for_batch(1, 0, 4, 0, 3, first_batch_position=2)),
        ("maskable", lambda: loss_weights(corrupt(x, cfg, key), cfg, torch.ones(2, 9, dtype=torch.bool))),
        ("multiple_of", lambda: varilen_length(cfg, 0, 0, 8, 0)),
        ("multiple_of", lambda: varilen_length(cfg, 0, 0, 8, 9)),
        ("seq_length", lambda: varilen_length(cfg, 0, 0, 0)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()


# ---------------------------------------------------------------- devices

@pytest.mark.gpu
def test_cpu_and_cuda_masks_bit_identical():
    for t_sampling in ("uniform", "antithetic"):
        cfg = cfg_(t_sampling=t_sampling, loss_weight="inverse_empirical", per_document_t=True)
        x = torch.randint(0, 100, (16, 1024), generator=torch.Generator().manual_seed(0))
        docs = (torch.arange(1024) // 300).expand(16, 1024)
        key = CorruptionKey.for_batch(5, 3, 32, 2 ** 40, 16, first_batch_position=16)
        cpu = corrupt(x, cfg, key, None, docs)
        gpu = corrupt(x.cuda(), cfg, key, None, docs.cuda())
        assert torch.equal(cpu.masked_positions, gpu.masked_positions.cpu())
        assert torch.equal(cpu.p_mask, gpu.p_mask.cpu())
        assert torch.equal(sample_t(cfg, key), sample_t(cfg, key, "cuda").cpu())
        big = torch.arange(2 ** 40, 2 ** 40 + 10 ** 6)
        assert torch.equal(keyed_bits(1, 0, big), keyed_bits(1, 0, big.cuda()).cpu())
