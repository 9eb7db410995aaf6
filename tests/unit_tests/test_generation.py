"""Generation: the model side (inference_forward + KV cache), LLaDA parity of the diffusion
sampler, left padding, EOS, AR decoding, Fast-dLLM caching / threshold, option validation."""

import pytest
import torch

from megatron.core.inference import generation
from megatron.core.inference.generation import generate
from megatron.core.inference.kv_cache import KVCache
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.attention_backends import core_attention
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

VOCAB = 64
MASK_ID = 63
EOS_ID = 62


def build(mode="difflm-noshift", mask_type="no_mask", block_size=None, backend="math", seed=0, **dlm) -> GPTModel:
    # A large init std makes a random model's predictions depend on the context, so
    # token-for-token comparisons are not trivially equal (std 0.02 predicts one token everywhere).
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, vocab_size=VOCAB, max_position_embeddings=64, qk_layernorm=True,
                               attention_backend=backend, init_method_std=0.5)
    dlm = DLMConfig(model_running_mode=mode, attention_mask_type=mask_type, block_size=block_size,
                    mask_token_id=MASK_ID, **dlm)
    torch.manual_seed(seed)
    return GPTModel(config, dlm).eval()


def without_mask_column(logits: torch.Tensor) -> torch.Tensor:
    """A trained DLM never predicts [MASK]; make the random model behave so too (finite, so
    that CFG's difference of two logits stays defined)."""
    logits = logits.clone()
    logits[..., MASK_ID] = -1e4
    return logits


def model_fn_of(model: GPTModel):
    def model_fn(ids, positions, mask, cache, start):
        return without_mask_column(model.inference_forward(ids, positions, mask, cache, start))
    return model_fn


def prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS_ID, (length,), generator=generator) for length in lengths]


def left_pad(rows, pad=0):
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row):] = row
        mask[index, width - len(row):] = 1
    return ids, mask


# ---------------------------------------------------------------------------- model side
def full_mask(batch, seq, causal=False):
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    return allowed.expand(batch, seq, seq)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_inference_forward_without_cache_equals_forward(mode, backend):
    model = build(mode, backend=backend)
    ids = prompts([12, 12])
    ids = torch.stack(ids)
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        expected = model(ids)
    got = model.inference_forward(ids, positions, full_mask(2, 12, causal=mode == "vanilla"))
    assert got.dtype == torch.float32 and got.shape == (2, 12, VOCAB)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_inference_forward_with_cache_equals_full_forward_at_the_slice():
    model = build()
    ids = torch.stack(prompts([12, 12]))
    positions = torch.arange(12).expand(2, 12)
    expected = model.inference_forward(ids, positions, full_mask(2, 12))
    cache = KVCache(2, 12)
    filled = model.inference_forward(ids, positions, full_mask(2, 12), cache, 0)
    torch.testing.assert_close(filled, expected, rtol=1e-5, atol=1e-5)
    assert sorted(cache.keys) == [0, 1] and cache.keys[0].shape == (2, 2, 12, 8)
    sliced = model.inference_forward(ids[:, 4:9], positions[:, 4:9], full_mask(2, 12)[:, 4:9], cache, 4)
    torch.testing.assert_close(sliced, expected[:, 4:9], rtol=1e-5, atol=1e-5)


def test_incremental_causal_decoding_with_cache_equals_full_forward():
    model = build("vanilla")
    ids = torch.stack(prompts([10, 10]))
    positions = torch.arange(10).expand(2, 10)
    expected = model.inference_forward(ids, positions, full_mask(2, 10, causal=True))
    cache = KVCache(None, 10)
    mask = full_mask(2, 10, causal=True)
    pieces = [model.inference_forward(ids[:, :6], positions[:, :6], mask[:, :6], cache, 0)]
    for index in range(6, 10):
        pieces.append(model.inference_forward(ids[:, index:index + 1], positions[:, index:index + 1],
                                              mask[:, index:index + 1], cache, index))
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
def test_explicit_mask_with_fewer_queries_than_keys_matches_math(backend):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=generator)
    k, v = torch.randn(2, 2, 7, 8, generator=generator), torch.randn(2, 2, 7, 8, generator=generator)
    allowed = torch.rand(2, 3, 7, generator=generator) > 0.4
    allowed[..., 0] = True
    mask = AttentionMask("explicit", allowed=allowed)
    reference = core_attention(q, k, v, mask, backend="math")
    torch.testing.assert_close(core_attention(q, k, v, mask, backend=backend), reference, rtol=1e-5, atol=1e-5)
    # Key 6 hidden from every query: changing it changes nothing.
    allowed[..., 6] = False
    k2 = k.clone()
    k2[:, :, 6] += 5.0
    torch.testing.assert_close(core_attention(q, k2, v, AttentionMask("explicit", allowed=allowed)),
                               core_attention(q, k, v, AttentionMask("explicit", allowed=allowed)))


def test_structured_masks_still_require_self_attention_shapes():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="explicit mask"):
        core_attention(q, k, k, AttentionMask("no_mask"))
    with pytest.raises(ValueError, match="allowed has shape"):
        core_attention(q, k, k, AttentionMask("explicit", allowed=torch.ones(1, 3, 4, dtype=torch.bool)))


def test_kv_cache_update_and_reset():
    cache = KVCache(3, 6)
    key = torch.ones(2, 1, 2, 4)
    keys, values = cache.update(1, 3, key, 2 * key)
    assert keys.shape == (2, 1, 6, 4) and cache.filled_length == 5
    assert keys[:, :, 3:5].eq(1).all() and keys[:, :, :3].eq(0).all() and values[:, :, 3:5].eq(2).all()
    with pytest.raises(ValueError, match="outside"):
        cache.update(1, 5, key, key)
    with pytest.raises(ValueError, match="reset"):
        cache.update(1, 0, torch.ones(3, 1, 2, 4), torch.ones(3, 1, 2, 4))
    cache.reset()
    assert not cache.keys and cache.filled_length == 0


def test_kv_cache_tensor_start_writes_where_an_int_start_does():
    """A tensor of slots (what CUDA graphs replay with) gives the int offset's buffers, and a
    model run with it gives the same logits."""
    by_int, by_tensor = KVCache(None, 6), KVCache(None, 6)
    key, value = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    for start in (2, 0):
        expected = by_int.update(0, start, key + start, value - start)
        got = by_tensor.update(0, torch.arange(start, start + 3), key + start, value - start)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with pytest.raises(ValueError, match=r"the \[3\] int64 tensor of the slots"):
        by_tensor.update(0, torch.tensor(1), key, value)
    model = build()
    ids = torch.stack(prompts([5]))
    positions, mask = torch.arange(5)[None], torch.ones(1, 5, 5, dtype=torch.bool)
    with torch.no_grad():
        expected = model.inference_forward(ids, positions, mask, KVCache(None, 5), 0)
        got = model.inference_forward(ids, positions, mask, KVCache(None, 5), torch.arange(5))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------- LLaDA parity
def llada_reference(model, prompt, steps, gen_length, block_length, cfg_scale=0.0, remasking="low_confidence",
                    generator=None):
    """LLaDA's generate() (dlm_anchors.md 2.1), written out: a full forward every step, no
    cache, no padding, greedy; prompt [B, P] of equal lengths."""
    batch, prompt_length = prompt.shape
    x = torch.full((batch, prompt_length + gen_length), MASK_ID, dtype=torch.long)
    x[:, :prompt_length] = prompt
    prompt_index = x != MASK_ID
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for block in range(num_blocks):
        block_start = prompt_length + block * block_length
        block_end = block_start + block_length
        masked_in_block = (x[:, block_start:block_end] == MASK_ID).sum(dim=1)
        counts = torch.zeros(batch, steps_per_block, dtype=torch.long) + (masked_in_block // steps_per_block)[:, None]
        for row in range(batch):
            counts[row, :int(masked_in_block[row] % steps_per_block)] += 1
        for step in range(steps_per_block):
            mask_index = x == MASK_ID
            with torch.no_grad():
                if cfg_scale > 0:
                    unconditional = x.clone()
                    unconditional[prompt_index] = MASK_ID
                    both = without_mask_column(model(torch.cat([x, unconditional])).float())
                    conditional, uncond_logits = both.chunk(2)
                    logits = uncond_logits + (cfg_scale + 1) * (conditional - uncond_logits)
                else:
                    logits = without_mask_column(model(x).float())
            x0 = logits.argmax(dim=-1)
            if remasking == "low_confidence":
                probs = torch.softmax(logits.double(), dim=-1)
                x0_p = probs.gather(-1, x0[..., None]).squeeze(-1)
            else:
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), generator=generator).double()
            x0_p[:, block_end:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf"), dtype=torch.float64))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for row in range(batch):
                transfer[row, confidence[row].topk(int(counts[row, step])).indices] = True
            x[transfer] = x0[transfer]
    return x


LLADA_SETTINGS = [(16, 16, 16), (16, 8, 4), (16, 4, 8), (12, 6, 4), (8, 8, 2)]


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
@pytest.mark.parametrize("gen_length,steps,block_length", LLADA_SETTINGS)
def test_greedy_low_confidence_equals_llada_reference(gen_length, steps, block_length, cfg_scale):
    model = build()
    prompt = torch.stack(prompts([5, 5]))
    expected = llada_reference(model, prompt, steps, gen_length, block_length, cfg_scale)
    got = generate(model_fn_of(model), prompt, running_mode="difflm-noshift", mask_token_id=MASK_ID,
                   gen_length=gen_length, steps=steps, block_length=block_length, cfg_scale=cfg_scale)
    assert not (got == MASK_ID).any()
    assert torch.equal(got, expected)


def test_megadlms_option_names_give_the_same_result():
    model = build()
    prompt = torch.stack(prompts([5]))
    llada = model.generate(prompt, gen_length=8, steps=4, block_length=4, cfg_scale=0.5)
    megadlms = model.generate(prompt, max_new_tokens=8, sample_steps=4, inference_block_size=4, cfg=0.5)
    assert torch.equal(llada, megadlms)


@pytest.mark.parametrize("gen_length,steps,block_length", [(16, 8, 4), (16, 16, 16)])
def test_random_remasking_with_a_fixed_generator_equals_llada_reference(gen_length, steps, block_length):
    model = build()
    prompt = torch.stack(prompts([4, 4]))
    expected = llada_reference(model, prompt, steps, gen_length, block_length, remasking="random",
                               generator=torch.Generator().manual_seed(7))
    got = generate(model_fn_of(model), prompt, running_mode="difflm-noshift", mask_token_id=MASK_ID,
                   gen_length=gen_length, steps=steps, block_length=block_length, remasking="random",
                   generator=torch.Generator().manual_seed(7))
    assert torch.equal(got, expected)
    greedy = generate(model_fn_of(model), prompt, running_mode="difflm-noshift", mask_token_id=MASK_ID,
                      gen_length=gen_length, steps=steps, block_length=block_length)
    assert not torch.equal(got, greedy)


# ---------------------------------------------------------------------------- left padding
DLM_BATCH_CASES = [dict(mode="difflm-noshift"), dict(mode="difflm-noshift", cfg_scale=1.0),
                   dict(mode="difflm-shift"), dict(mode="difflm-noshift", cache="dual", threshold=0.3),
                   dict(mode="difflm-noshift", mask_type="block_causal", block_size=4, cache="prefix")]


@pytest.mark.parametrize("case", DLM_BATCH_CASES, ids=lambda case: "-".join(str(v) for v in case.values()))
def test_left_padded_batch_equals_one_prompt_at_a_time_dlm(case):
    case = dict(case)
    model = build(case.pop("mode"), case.pop("mask_type", "no_mask"), case.pop("block_size", None))
    rows = prompts([3, 7, 5])
    ids, mask = left_pad(rows)
    options = dict(gen_length=8, steps=4, block_length=4, **case)
    batched = model.generate(ids, mask, **options)
    for index, row in enumerate(rows):
        alone = model.generate(row[None], **options)
        assert torch.equal(batched[index, ids.shape[1] - len(row):], alone[0]), index
        assert torch.equal(batched[index, :ids.shape[1]], ids[index])


def test_left_padded_batch_equals_one_prompt_at_a_time_ar():
    model = build("vanilla")
    rows = prompts([2, 6, 4])
    ids, mask = left_pad(rows)
    batched = model.generate(ids, mask, max_new_tokens=8)
    for index, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=8)
        assert torch.equal(batched[index, ids.shape[1] - len(row):], alone[0]), index


SEEDED_CASES = {  # (running mode, DLMConfig fields, generation options)
    "llada": ("difflm-noshift", {}, dict(steps=8, block_length=4)),
    "random_remasking": ("difflm-noshift", {}, dict(steps=8, block_length=4, remasking="random")),
    "threshold_cfg": ("difflm-noshift", {}, dict(block_length=4, threshold=0.3, cfg_scale=1.0)),
    "shift_top_k": ("difflm-shift", {}, dict(steps=8, block_length=4, top_k=5)),
    "block_diffusion": ("difflm-noshift", dict(block_diffusion=True, block_size=4), dict(steps=8)),
    "ar": ("vanilla", {}, {}),
}


@pytest.mark.parametrize("case", SEEDED_CASES)
def test_per_row_seeds_sample_a_row_alike_in_any_batch(case):
    """With `seeds` a row's sampled completion is the same alone, in a batch and in the batch reversed;
    one generator for the batch gives a row other draws when it is batched otherwise."""
    mode, dlm, extra = SEEDED_CASES[case]
    model = build(mode, **dlm)
    rows, seeds = prompts([3, 7, 5, 6]), [11, 12, 13, 2 ** 62]
    options = dict(gen_length=8, temperature=1.0, **extra)

    def completions(order, **noise):
        ids, mask = left_pad([rows[index] for index in order])
        out = model.generate(ids, mask, **noise, **options)
        return [out[slot, ids.shape[1]:] for slot in range(len(order))]

    alone = [completions([index], seeds=[seeds[index]])[0] for index in range(4)]
    batched = completions([0, 1, 2, 3], seeds=seeds)
    reverse = completions([3, 2, 1, 0], seeds=seeds[::-1])[::-1]
    for index in range(4):
        assert torch.equal(batched[index], alone[index]) and torch.equal(reverse[index], alone[index]), index
    assert len({tuple(row.tolist()) for row in alone}) > 1
    shared = completions([0, 1, 2, 3], generator=torch.Generator().manual_seed(5))
    each = [completions([index], generator=torch.Generator().manual_seed(5))[0] for index in range(4)]
    assert any(not torch.equal(shared[index], each[index]) for index in range(4))


def test_per_row_seeds_draw_from_the_softmax_row_by_row():
    logits = torch.tensor([0.0, torch.tensor(3.0).log().item(), -30.0]).expand(4000, 3)
    options = generation.GenerationOptions(temperature=1.0, seeds=tuple(range(4000)))
    tokens, _, _ = generation._predict(logits, options, (5, 2))
    assert abs((tokens == 1).float().mean().item() - 0.75) < 0.03
    again, _, _ = generation._predict(logits, options, (5, 2))
    other, _, _ = generation._predict(logits, options, (5, 3))
    assert torch.equal(tokens, again) and not torch.equal(tokens, other)
    assert (tokens == other).float().mean() < 0.75  # another step's draw: independent, not a copy


def test_right_padding_is_rejected_before_the_model_runs():
    def model_fn(*args):
        raise AssertionError("the model must not be called")
    ids, mask = left_pad(prompts([2, 4]))
    with pytest.raises(ValueError, match="left padding"):
        generate(model_fn, ids, mask.flip(1), running_mode="difflm-noshift", mask_token_id=MASK_ID, gen_length=4)


# ---------------------------------------------------------------------------- autoregressive
def test_ar_with_cache_equals_without_cache_and_a_plain_argmax_loop():
    model = build("vanilla")
    prompt = torch.stack(prompts([5, 5]))
    cached = model.generate(prompt, max_new_tokens=10)
    uncached = model.generate(prompt, max_new_tokens=10, use_cache=False)
    sequence = prompt.clone()
    with torch.no_grad():
        for _ in range(10):
            sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(uncached, sequence)
    assert torch.equal(cached, sequence)
    assert len(set(sequence[:, 5:].flatten().tolist())) > 3  # not a degenerate repetition


def test_ar_sampling_is_reproducible_and_follows_the_filters():
    model = build("vanilla")
    prompt = torch.stack(prompts([5, 5]))
    options = dict(max_new_tokens=8, temperature=1.0, top_k=3)
    first = model.generate(prompt, generator=torch.Generator().manual_seed(3), **options)
    second = model.generate(prompt, generator=torch.Generator().manual_seed(3), **options)
    assert torch.equal(first, second)
    assert not torch.equal(first, model.generate(prompt, max_new_tokens=8))


def test_sampling_draws_from_the_softmax_and_filters_cut_the_tail():
    logits = torch.tensor([0.0, torch.tensor(3.0).log().item(), -30.0]).expand(20000, 3)
    options = generation.GenerationOptions(temperature=1.0, generator=torch.Generator().manual_seed(0))
    tokens, probability, _ = generation._predict(logits, options, (0,))
    assert abs((tokens == 1).float().mean().item() - 0.75) < 0.02
    torch.testing.assert_close(probability[tokens == 1], torch.full_like(probability[tokens == 1], 0.75),
                               rtol=1e-4, atol=1e-4)
    hot = generation.GenerationOptions(temperature=2.0, generator=torch.Generator().manual_seed(1))
    tokens, probability, _ = generation._predict(logits, hot, (0,))  # softmax(l / 2): 1 : sqrt(3)
    assert abs((tokens == 1).float().mean().item() - 3 ** 0.5 / (1 + 3 ** 0.5)) < 0.02 and (tokens != 2).all()
    torch.testing.assert_close(probability[tokens == 1], torch.full_like(probability[tokens == 1], 0.75))
    row = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(generation._filter_logits(row, 2, None)[0, 2:]).all()
    nucleus = generation._filter_logits(row, None, 0.7)  # probs .64 .24 .09 .03: keeps two
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()


def test_the_inverse_cdf_draw_never_takes_a_token_of_probability_zero():
    """Each uniform picks the token whose share of [0, 1) holds it; the zero-probability slots (filtered or
    ruled out: the mask token, the vocabulary padding) are never drawn, at u = 0 or at the largest u < 1,
    where u x total can round up to the total."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0], dtype=torch.float64).expand(6, 5)
    top = 1.0 - 2.0 ** -53
    u = torch.tensor([0.0, 0.25 - 1e-12, 0.25, 0.5, 0.99, top], dtype=torch.float64)
    assert generation.inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3, 3]
    total = torch.tensor([1.0, 2.0 ** 40, 3.0], dtype=torch.float64)[:, None]  # unnormalised rows
    assert generation.inverse_cdf(probs[:3] * total, torch.full((3,), top, dtype=torch.float64)).tolist() == [3] * 3
    assert generation.inverse_cdf(probs[:3] * total, torch.zeros(3, dtype=torch.float64)).tolist() == [1] * 3


def test_ar_records_the_entropy_of_each_sampled_token():
    """The entropy the sampler records is the policy's at each generated token (the model's softmax before
    temperature and top-k), as a teacher-forced forward over the result gives it."""
    model = build("vanilla")
    prompt = torch.stack(prompts([5, 5]))
    entropy = torch.full((2, 6), float("nan"))
    out = model.generate(prompt, max_new_tokens=6, temperature=1.5, top_k=4, entropy=entropy,
                         seeds=[1, 2])
    with torch.no_grad():
        probs = model(out)[:, 4:-1].float().softmax(dim=-1)
    expected = -(probs * probs.log()).sum(dim=-1)
    torch.testing.assert_close(entropy, expected, rtol=1e-4, atol=1e-4)
    assert entropy.std() > 0.01


@pytest.mark.parametrize("options", [dict(steps=8, block_length=4), dict(threshold=0.5, block_length=8)])
def test_dlm_records_the_entropy_each_token_was_committed_from(options):
    """A scripted model whose slot p puts margin c_p on one token: the distribution over the vocabulary but
    the mask token has the closed-form entropy log Z - c_p e^c_p / Z, Z = e^c_p + V - 2."""
    margins = torch.linspace(1.0, 6.0, 11)
    model_fn, _ = scripted_model(torch.full((2, 11), 20), margins)
    entropy = torch.zeros(2, 8)
    generate(model_fn, torch.tensor([[5, 6, 7], [8, 9, 10]]), running_mode="difflm-noshift", mask_token_id=MASK_ID,
             gen_length=8, entropy=entropy, **options)
    z = margins[3:].double().exp() + VOCAB - 2
    expected = (z.log() - margins[3:] * margins[3:].double().exp() / z).float()
    torch.testing.assert_close(entropy, expected.expand(2, 8), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"entropy must be a float \[2, 8\] tensor"):
        generate(model_fn, torch.tensor([[5, 6, 7], [8, 9, 10]]), running_mode="difflm-noshift",
                 mask_token_id=MASK_ID, gen_length=8, entropy=torch.zeros(2, 7))


# ---------------------------------------------------------------------------- EOS
def scripted_model(targets: torch.Tensor, confidence: torch.Tensor):
    """A model_fn that ignores context: at canvas slot p of row b it predicts targets[b, p] with a
    margin confidence[p]; records the tokens of every call."""
    calls = []

    def model_fn(ids, positions, mask, cache, start):
        calls.append(ids.clone())
        batch, length = ids.shape
        slots = torch.arange(start, start + length)
        logits = torch.zeros(batch, length, VOCAB)
        logits.scatter_(-1, targets[:, slots, None], confidence[slots].expand(batch, length)[..., None])
        return logits

    return model_fn, calls


def test_dlm_stops_per_sequence_at_eos():
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    targets = torch.full((2, 11), 20)
    targets[0, 3 + 2] = EOS_ID
    targets[1, 3 + 4] = EOS_ID
    # Confidence falls left to right: one token per step, in reading order.
    model_fn, calls = scripted_model(targets, torch.linspace(9.0, 5.0, 11))
    out = generate(model_fn, prompt, running_mode="difflm-noshift", mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                   pad_token_id=0, gen_length=8, steps=8, block_length=8)
    assert out[0, 3:].tolist() == [20, 20, EOS_ID, 0, 0, 0, 0, 0]
    assert out[1, 3:].tolist() == [20, 20, 20, 20, EOS_ID, 0, 0, 0]
    assert len(calls) == 5  # row 1 is done after its fifth token; no further steps


def test_dlm_eos_needs_every_earlier_token_unmasked():
    prompt = torch.tensor([[5, 6, 7]])
    targets = torch.full((1, 11), 20)
    targets[0, 3 + 2] = EOS_ID
    # Confidence rises left to right: the EOS is committed before the tokens it follows.
    model_fn, calls = scripted_model(targets, torch.linspace(5.0, 9.0, 11))
    out = generate(model_fn, prompt, running_mode="difflm-noshift", mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                   gen_length=8, steps=8, block_length=8)
    assert out[0, 3:].tolist() == [20, 20, EOS_ID] + [EOS_ID] * 5  # no pad id: filled with EOS
    assert len(calls) == 8
    # The 7th step sees the EOS committed but slots 3-4 still masked: not finished, nothing filled.
    assert calls[6][0, 3:].tolist() == [MASK_ID, MASK_ID, EOS_ID, 20, 20, 20, 20, 20]


def test_ar_stops_per_sequence_at_eos():
    prompt = torch.tensor([[5, 6], [8, 9]])
    targets = torch.full((2, 10), 20)
    targets[0, 3] = EOS_ID  # the logits at slot 3 predict slot 4
    targets[1, 5] = EOS_ID
    model_fn, calls = scripted_model(targets, torch.full((10,), 5.0))
    out = generate(model_fn, prompt, running_mode="vanilla", eos_token_id=EOS_ID, pad_token_id=0, max_new_tokens=8)
    assert out[0, 2:].tolist() == [20, 20, EOS_ID, 0, 0, 0, 0, 0]
    assert out[1, 2:].tolist() == [20, 20, 20, 20, EOS_ID, 0, 0, 0]
    assert len(calls) == 5


# ---------------------------------------------------------------------------- Fast-dLLM options
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [None, 0.9])
def test_cache_and_threshold_give_vocabulary_tokens(cache, threshold):
    model = build()
    ids, mask = left_pad(prompts([3, 6]))
    out = model.generate(ids, mask, gen_length=16, steps=8, block_length=4, cache=cache, threshold=threshold)
    generated = out[:, ids.shape[1]:]
    assert out.shape == (2, ids.shape[1] + 16)
    assert not (generated == MASK_ID).any() and (generated >= 0).all() and (generated < VOCAB).all()


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_cache_equals_no_cache_when_context_does_not_matter(mode, cache, threshold):
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, EOS_ID, (2, 20), generator=generator)
    confidence = torch.rand(20, generator=generator) * 6
    prompt = torch.stack(prompts([4, 4]))
    options = dict(running_mode=mode, mask_token_id=MASK_ID, gen_length=16, steps=8, block_length=4,
                   threshold=threshold)
    uncached = generate(scripted_model(targets, confidence)[0], prompt, **options)
    cached = generate(scripted_model(targets, confidence)[0], prompt, cache=cache, **options)
    assert torch.equal(cached, uncached)
    shift = int(mode == "difflm-shift")
    assert torch.equal(uncached[:, 4:], targets[:, 4 - shift:20 - shift])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_block_kv_cache_is_exact_for_block_causal_models(cache):
    # Finished blocks never see later ones under block-causal attention, so the cached K/V
    # are exactly what a full forward computes: the cached sampler must match the uncached one.
    model = build(mask_type="block_causal", block_size=4)
    prompt = torch.stack(prompts([8, 8]))
    options = dict(gen_length=12, steps=6, block_length=4)
    expected = model.generate(prompt, **options)
    assert torch.equal(model.generate(prompt, cache=cache, **options), expected)
    assert torch.equal(model.generate(prompt, cache=cache, cfg=1.0, **options), model.generate(prompt, cfg=1.0,
                                                                                               **options))


# ---------------------------------------------------------------------------- validation
def never_called(*args):
    raise AssertionError("validation must happen before any model call")


@pytest.mark.parametrize("options,message", [
    (dict(gen_length=10, block_length=4), r"gen_length \(max_new_tokens\)=10 is not a multiple of block_length"),
    (dict(max_new_tokens=8, inference_block_size=4, sample_steps=3), r"steps \(sample_steps\)=3 .* 2 blocks"),
    (dict(gen_length=8, max_new_tokens=16), r"gen_length \(max_new_tokens\) is given twice"),
    (dict(cfg=1.0, cfg_scale=2.0), r"cfg_scale \(cfg\) is given twice"),
    (dict(gen_length=8, num_beams=2), r"unknown generation option 'num_beams'"),
    (dict(remasking="entropy"), r"remasking='entropy' is not one of"),
    (dict(cache="full"), r"cache='full' is not one of"),
    (dict(use_cache=False), r"use_cache applies to autoregressive"),
    (dict(threshold=0.9, remasking="random"), r"threshold decoding"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(attention_mask_type="block_causal"), r"attention_block_size"),
])
def test_bad_dlm_options_raise_a_clear_error_before_the_model_runs(options, message):
    with pytest.raises(ValueError, match=message):
        generate(never_called, torch.tensor([[1, 2]]), running_mode="difflm-noshift", mask_token_id=MASK_ID,
                 **options)


def test_bad_ar_options_and_inputs_raise_clear_errors():
    prompt = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match=r"steps \(sample_steps\) applies to diffusion"):
        generate(never_called, prompt, running_mode="vanilla", sample_steps=4)
    with pytest.raises(ValueError, match="cannot decode autoregressively"):
        generate(never_called, prompt, running_mode="vanilla", attention_mask_type="no_mask")
    with pytest.raises(ValueError, match="mask_token_id"):
        generate(never_called, prompt, running_mode="difflm-noshift")
    with pytest.raises(ValueError, match="running_mode"):
        generate(never_called, prompt, running_mode="diffusion")
    with pytest.raises(ValueError, match="either generator .* or seeds"):
        generate(never_called, prompt, running_mode="vanilla", seeds=[1], generator=torch.Generator())
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        generate(never_called, prompt, running_mode="vanilla", seeds=[1, 2])
    with pytest.raises(ValueError, match="at least one real token"):
        generate(never_called, prompt, torch.tensor([[0, 0]]), running_mode="difflm-shift", mask_token_id=MASK_ID)


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_select_commits_what_a_per_row_topk_commits(threshold):
    """The batched selection (no per-row loop, no host sync) against the plain per-row rule:
    the `count` most confident masked slots, or those above the threshold plus the best one."""
    generator = torch.Generator().manual_seed(5)
    confidence = torch.rand(6, 9, generator=generator, dtype=torch.float64)
    masked = torch.rand(6, 9, generator=generator) < 0.6
    masked[4] = False  # a finished row: nothing to commit
    count = torch.tensor([0, 1, 2, 3, 9, 4])  # 9 > masked slots: capped at what the row has
    got = generation._select(confidence, masked, None if threshold else count, threshold)
    for row in range(6):
        slots = [slot for slot in range(9) if masked[row, slot]]
        ranked = sorted(slots, key=lambda slot: -confidence[row, slot].item())
        if threshold is None:
            expected = set(ranked[:int(count[row])])
        else:
            expected = {slot for slot in slots if confidence[row, slot] > threshold} | set(ranked[:1])
        assert set(got[row].nonzero().flatten().tolist()) == expected, row


def test_guidance_keeps_the_vocabulary_padding_ruled_out():
    """A padded vocabulary's columns are -inf in both halves of CFG: sampling and the likelihood stay
    finite and never pick them (the plain formula gives -inf - -inf = NaN there)."""
    from megatron.core.inference.likelihood import log_likelihood

    model = build()

    def padded(ids, positions, mask, cache, start):
        logits = without_mask_column(model.inference_forward(ids, positions, mask, cache, start))
        return logits.index_fill(-1, torch.arange(40, VOCAB - 1), float("-inf"))

    prompt = torch.stack(prompts([4, 4]))
    out = generate(padded, prompt, running_mode="difflm-noshift", mask_token_id=MASK_ID, gen_length=8, steps=8,
                   block_length=4, cfg_scale=1.0)
    assert (out[:, 4:] < 40).all()
    score = log_likelihood(padded, prompt[0], torch.tensor([1, 2, 3]), running_mode="difflm-noshift",
                           mask_token_id=MASK_ID, mc_num=4, batch_size=4, cfg_scale=0.5)
    assert torch.isfinite(torch.tensor(score))
