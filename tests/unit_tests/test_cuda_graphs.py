"""CUDA-graph generation (megatron.core.inference.cuda_graphs): replays give the eager tokens and
logits, across calls with new prompts, with and without a KV cache; clear errors without CUDA."""

import subprocess
import sys
import os

import pytest
import torch

from megatron.core.inference.cuda_graphs import CUDAGraphRunner
from megatron.core.inference.generation import generate
from megatron.core.inference.kv_cache import KVCache

from tests.unit_tests.test_generation import MASK_ID, build, model_fn_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def recording(model_fn, log):
    def recorded(ids, positions, mask, cache, start):
        logits = model_fn(ids, positions, mask, cache, start)
        log.append(logits)
        return logits
    return recorded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_the_runner_and_the_benchmark_flag_say_what_to_do():
    model = build()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CUDAGraphRunner(model.inference_forward)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), cuda_graphs=True, gen_length=4, block_length=4, steps=4)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools/benchmark/generation_throughput.py"),
                          "--model", "tiny", "--cuda-graphs"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--cuda-graphs needs a CUDA device" in run.stderr


CASES = [  # (running mode, options, graphs captured by one generation)
    ("difflm-noshift", dict(), 1),
    ("difflm-noshift", dict(cache="dual", threshold=0.5), 2),  # the full refresh, the block at any offset
    ("difflm-shift", dict(cache="prefix"), 1 + 3),  # the refresh, then [block start, end) of 3 lengths
    ("difflm-noshift", dict(cfg_scale=1.0), 1),
    ("vanilla", dict(use_cache=True), 2),  # the prompt pass, one token at any offset
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,options,captured", CASES)
def test_replayed_generation_equals_eager_across_prompts(mode, options, captured):
    model = build(mode, backend="sdpa").cuda()
    eager_fn = model_fn_of(model)
    runner = CUDAGraphRunner(eager_fn)
    lengths = dict(gen_length=12, block_length=4, steps=12) if mode != "vanilla" else dict(gen_length=12)
    generator = torch.Generator().manual_seed(3)
    for call in range(3):  # new prompts each call: the replays must read the new inputs and cache
        prompt = torch.randint(0, MASK_ID - 2, (2, 6), generator=generator).cuda()
        eager_log, graph_log = [], []
        expected = generate(recording(eager_fn, eager_log), prompt, running_mode=mode, mask_token_id=MASK_ID,
                            temperature=0.0, **lengths, **options)
        replays = runner.replays
        got = generate(recording(runner, graph_log), prompt, running_mode=mode, mask_token_id=MASK_ID,
                       temperature=0.0, **lengths, **options)
        assert torch.equal(got, expected), f"call {call}"
        assert len(graph_log) == len(eager_log)
        for step, (graph_logits, eager_logits) in enumerate(zip(graph_log, eager_log)):
            torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-5, atol=1e-5, msg=f"call {call} step {step}")
        if call:  # the first call captured; later ones replay every forward
            assert runner.replays - replays == len(graph_log)
    assert len(runner.graphs) == captured


@pytest.mark.gpu
def test_outputs_survive_the_next_replay_and_model_generate_keeps_its_graphs():
    model = build(backend="sdpa").cuda()
    runner = CUDAGraphRunner(model.inference_forward)
    positions = torch.arange(8, device="cuda").expand(1, 8)
    mask = torch.ones(1, 8, 8, dtype=torch.bool, device="cuda")
    ids = [torch.randint(0, MASK_ID, (1, 8), device="cuda") for _ in range(3)]
    outputs = [runner(tokens, positions, mask) for tokens in ids]  # eager + capture, replay, replay
    for tokens, output in zip(ids, outputs):
        torch.testing.assert_close(output, model.inference_forward(tokens, positions, mask), rtol=1e-5, atol=1e-5)
    assert runner.replays == 2
    with pytest.raises(ValueError, match=r"cache_start 4 \+ 8 positions fall outside"):
        runner(ids[0], positions, mask, KVCache(None, 8), 4)
    prompt = ids[0][:, :4]
    first = model.generate(prompt, cuda_graphs=True, gen_length=8, block_length=4, steps=8, temperature=0.0)
    graphs = dict(model._graph_runner.graphs)
    second = model.generate(prompt, cuda_graphs=True, gen_length=8, block_length=4, steps=8, temperature=0.0)
    assert torch.equal(first, second) and model._graph_runner.graphs == graphs and model._graph_runner.replays > 0
    # New weight tensors: the old graphs would read freed memory, so generate captures anew.
    runner = model._graph_runner
    model.to(torch.float64)
    third = model.generate(prompt, cuda_graphs=True, gen_length=8, block_length=4, steps=8, temperature=0.0)
    assert model._graph_runner is not runner
    assert torch.equal(third, model.generate(prompt, gen_length=8, block_length=4, steps=8, temperature=0.0))


@pytest.mark.gpu
def test_graphs_over_compiled_layers_generate_as_eager():
    from megatron.core.transformer.compilation import compile_transformer_layers

    model = build(backend="sdpa").cuda()
    prompt = torch.randint(0, MASK_ID - 2, (2, 6), device="cuda")
    options = dict(running_mode="difflm-noshift", mask_token_id=MASK_ID, temperature=0.0, gen_length=12,
                   block_length=4, steps=12, cache="dual")
    expected = generate(model.inference_forward, prompt, **options)
    compile_transformer_layers(model, dynamic=True)
    runner = CUDAGraphRunner(model.inference_forward)
    for _ in range(2):
        assert torch.equal(generate(runner, prompt, **options), expected)
    assert runner.replays > 0
