"""Answer log-likelihoods (megatron.core.inference.likelihood): the DLM Monte Carlo estimate
converges to the exact expectation of LLaDA's ELBO (every masking enumerated), in both
diffusion modes and with guidance; AR scores are exact; seeds reproduce; bad input is named."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference.likelihood import log_likelihood

from tests.unit_tests.test_generation import MASK_ID, build

PROMPT = torch.tensor([5, 17, 3, 40])
ANSWER = torch.tensor([8, 22, 51])


def exact_elbo(model, mode: str, cfg_scale: float = 0.0, weighted: bool = True) -> float:
    """Minus E[(A / l) * CE of the masked answer tokens], l uniform on 1..A and the masked set
    uniform among those of size l: every masking is run once."""
    sequence = torch.cat([PROMPT, ANSWER])
    length, first = len(ANSWER), len(PROMPT)
    positions = torch.arange(len(sequence))[None]
    allowed = torch.ones(1, len(sequence), len(sequence), dtype=torch.bool)
    expected = 0.0
    for count in range(1, length + 1):
        subsets = list(itertools.combinations(range(length), count))
        for subset in subsets:
            slots = [first + index for index in subset]
            noisy = sequence.clone()
            noisy[slots] = MASK_ID
            with torch.no_grad():
                logits = model.inference_forward(noisy[None], positions, allowed).float()[0]
                if cfg_scale:
                    unconditional = noisy.clone()
                    unconditional[:first] = MASK_ID
                    other = model.inference_forward(unconditional[None], positions, allowed).float()[0]
                    logits = other + (cfg_scale + 1) * (logits - other)
            predictors = [slot - 1 for slot in slots] if mode == "difflm-shift" else slots
            loss = F.cross_entropy(logits[predictors], sequence[slots], reduction="sum").item()
            expected += (length / count if weighted else 1.0) * loss / len(subsets)
    return -expected / length


@pytest.mark.parametrize("mode,cfg_scale", [("difflm-noshift", 0.0), ("difflm-shift", 0.0),
                                            ("difflm-noshift", 1.5)])
def test_monte_carlo_estimate_converges_to_the_exact_elbo(mode, cfg_scale):
    model = build(mode)
    estimate = log_likelihood(model.inference_forward, PROMPT, ANSWER, running_mode=mode, mask_token_id=MASK_ID,
                              mc_num=3072, batch_size=96, cfg_scale=cfg_scale,
                              generator=torch.Generator().manual_seed(0))
    exact = exact_elbo(model, mode, cfg_scale)
    assert estimate == pytest.approx(exact, abs=0.25), (estimate, exact)
    # The check has teeth: without the A / l weights the expectation is far away.
    assert abs(exact_elbo(model, mode, cfg_scale, weighted=False) - exact) > 1.0
    # The model method passes the mode, the mask id and the trained pattern.
    assert model.log_likelihood(PROMPT, ANSWER, mc_num=3072, batch_size=96, cfg_scale=cfg_scale,
                                generator=torch.Generator().manual_seed(0)) == pytest.approx(estimate, abs=1e-9)


def test_one_sample_per_masking_count_with_stratification():
    """batch_size == A: the stratified counts hit every l = 1..A exactly once per batch."""
    model = build()
    seen = []

    def recording(ids, positions, mask, cache, start):
        seen.append(((ids[:, len(PROMPT):] == MASK_ID).sum(dim=1).tolist(), (ids[:, :len(PROMPT)] == PROMPT).all()))
        return model.inference_forward(ids, positions, mask, cache, start)

    log_likelihood(recording, PROMPT, ANSWER, running_mode="difflm-noshift", mask_token_id=MASK_ID, mc_num=12,
                   batch_size=3, generator=torch.Generator().manual_seed(1))
    assert len(seen) == 4
    for counts, prompt_kept in seen:
        assert sorted(counts) == [1, 2, 3] and prompt_kept


def test_seeded_estimates_repeat_and_differ_across_seeds():
    model = build()

    def estimate(seed):
        return log_likelihood(model.inference_forward, PROMPT, ANSWER, running_mode="difflm-noshift",
                              mask_token_id=MASK_ID, mc_num=8, batch_size=4,
                              generator=torch.Generator().manual_seed(seed))

    assert estimate(3) == estimate(3) and estimate(3) != estimate(4)


def test_autoregressive_score_is_the_exact_sum_of_log_probabilities():
    model = build("vanilla")
    sequence = torch.cat([PROMPT, ANSWER])[None]
    with torch.no_grad():
        log_probs = model(sequence).float().log_softmax(dim=-1)[0]
    expected = sum(log_probs[len(PROMPT) + index - 1, token].item() for index, token in enumerate(ANSWER))
    assert model.log_likelihood(PROMPT, ANSWER) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("mode,prompt,answer,options,message", [
    ("difflm-noshift", PROMPT, torch.tensor([], dtype=torch.long), {}, "answer is empty"),
    ("difflm-noshift", PROMPT[None], ANSWER, {}, "prompt must be a 1-D tensor"),
    ("difflm-noshift", PROMPT, ANSWER, dict(mc_num=10, batch_size=4), "multiple of batch_size"),
    ("difflm-noshift", PROMPT, torch.tensor([1, MASK_ID]), {}, "holds the mask token"),
    ("difflm-shift", torch.tensor([], dtype=torch.long), ANSWER, {}, "prompt at least one token"),
    ("vanilla", torch.tensor([], dtype=torch.long), ANSWER, {}, "at least one prompt token"),
    ("difflm-noshift", PROMPT, ANSWER, dict(cfg_scale=-1.0), "cfg_scale"),
])
def test_bad_input_is_named(mode, prompt, answer, options, message):
    model = build(mode)
    with pytest.raises(ValueError, match=message):
        model.log_likelihood(prompt, answer, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["difflm-shift", "vanilla"])
def test_the_same_seed_gives_the_same_estimate_on_the_gpu(mode):
    """The masks are drawn on the CPU generator, so a CUDA model scores what the CPU one does."""
    model = build(mode)
    options = dict(mc_num=16, batch_size=8, cfg_scale=0.5) if mode != "vanilla" else {}
    on_cpu = model.log_likelihood(PROMPT, ANSWER, generator=torch.Generator().manual_seed(2), **options)
    model.cuda()
    on_gpu = model.log_likelihood(PROMPT.cuda(), ANSWER.cuda(), generator=torch.Generator().manual_seed(2), **options)
    assert on_gpu == pytest.approx(on_cpu, abs=1e-3)


BD3_PROMPT, BD3_ANSWER, BD3_BLOCK = torch.tensor([5, 17, 3]), torch.tensor([40, 8, 22, 51]), 4


def exact_block_elbo(model, block_causal: bool = True) -> float:
    """BD3's ELBO by enumeration: for each model block (4 slots from slot 0) holding answer tokens,
    minus E[(A_b / l) * CE of l masked ones of its A_b], every earlier block clean, under the
    block-causal mask (`block_causal=False`: every slot sees every other, later clean blocks included)."""
    sequence = torch.cat([BD3_PROMPT, BD3_ANSWER])
    width = len(sequence)
    slots = torch.arange(width)
    allowed = ((slots[None, :] // BD3_BLOCK) <= (slots[:, None] // BD3_BLOCK))[None]
    if not block_causal:
        allowed = torch.ones_like(allowed)
    total = 0.0
    for start, end in [(3, 4), (4, 7)]:
        length = end - start
        for count in range(1, length + 1):
            subsets = list(itertools.combinations(range(start, end), count))
            for subset in subsets:
                noisy = sequence.clone()
                noisy[list(subset)] = MASK_ID
                with torch.no_grad():
                    logits = model.inference_forward(noisy[None], slots[None], allowed).float()[0]
                loss = F.cross_entropy(logits[list(subset)], sequence[list(subset)], reduction="sum").item()
                total += (length / count) * loss / len(subsets) / length
    return -total


def test_block_diffusion_estimate_converges_to_the_block_wise_elbo():
    """A BD3 model's score masks each block's part of the answer alone, earlier blocks clean (the
    answer's first token shares the prompt's block): the estimate converges to that enumeration under
    the block-causal mask, far from the same enumeration with later blocks visible."""
    model = build(mask_type="no_mask", block_size=BD3_BLOCK)
    model.dlm_config.block_diffusion = True  # the trained pattern is then block_diffusion
    assert model.trained_pattern()["attention_mask_type"] == "block_diffusion"
    estimate = model.log_likelihood(BD3_PROMPT, BD3_ANSWER, mc_num=3072, batch_size=96,
                                    generator=torch.Generator().manual_seed(0))
    exact = exact_block_elbo(model)
    assert estimate == pytest.approx(exact, abs=0.25), (estimate, exact)
    assert abs(exact_block_elbo(model, block_causal=False) - exact) > 1.0


def test_block_diffusion_single_token_spans_are_exact():
    """Each block holds one answer token: it is always the one masked, so the score is exact (any
    seed): log p(40 | its block's clean prompt token, block 0) + log p(8 | both earlier blocks clean)."""
    model = build(mask_type="no_mask", block_size=2)
    model.dlm_config.block_diffusion = True
    prompt, answer = torch.tensor([5, 17, 3]), torch.tensor([40, 8])  # slot 3 shares block 1 with slot 2
    scores = {model.log_likelihood(prompt, answer, mc_num=4, batch_size=2, generator=torch.Generator().manual_seed(s))
              for s in (0, 1)}
    slots = torch.arange(5)
    allowed = ((slots[None, :] // 2) <= (slots[:, None] // 2))[None]
    expected = 0.0
    for slot, noisy in ((3, [5, 17, 3, MASK_ID, 8]), (4, [5, 17, 3, 40, MASK_ID])):
        with torch.no_grad():
            logits = model.inference_forward(torch.tensor([noisy]), slots[None], allowed).float()[0, slot]
        expected += logits.log_softmax(-1)[[40, 8][slot - 3]].item()
    assert len(scores) == 1 and scores.pop() == pytest.approx(expected, abs=1e-5)
