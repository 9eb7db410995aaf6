"""The block-diffusion sampler: block by block over the model's own blocks, the clean blocks in an
exact KV cache. Sampling with the cache equals sampling without it token for token (greedy), with
a partial prompt block, a cut last block, thresholds, CFG and prompts of other lengths; and what a
block is denoised from is what training's noisy half sees for it."""

import pytest
import torch

from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from tests.unit_tests.test_generation import EOS_ID, MASK_ID, VOCAB, left_pad, prompts

B = 4


def build(seed=0) -> GPTModel:
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, vocab_size=VOCAB, max_position_embeddings=64, qk_layernorm=True,
                               attention_backend="math", init_method_std=0.5)
    dlm = DLMConfig(model_running_mode="difflm-noshift", block_diffusion=True, block_size=B, mask_token_id=MASK_ID)
    torch.manual_seed(seed)
    return GPTModel(config, dlm).eval()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("extra", [{}, {"threshold": 0.3}, {"cfg": 1.0}, {"steps": 6}])
def test_the_exact_cache_gives_the_tokens_of_no_cache(cache, extra):
    model = build()
    prompt = torch.stack(prompts([6, 6]))       # the prompt ends inside a block: 2 of its 4 slots
    options = dict(gen_length=13, **extra)     # and the last block is cut
    expected = model.generate(prompt, **options)
    assert (expected[:, 6:] != MASK_ID).all()
    assert torch.equal(model.generate(prompt, cache=cache, **options), expected)


def test_prompts_of_other_lengths_give_what_each_gives_alone():
    model = build()
    rows = prompts([3, 6, 8])
    ids, mask = left_pad(rows)
    together = model.generate(ids, attention_mask=mask, gen_length=9, cache="prefix")
    for index, row in enumerate(rows):
        alone = model.generate(row[None], gen_length=9)
        assert torch.equal(together[index, ids.shape[1]:], alone[0, len(row):]), index


def test_a_block_is_denoised_from_what_training_shows_its_noisy_half():
    """At a sampling state (blocks < k committed, block k partly masked), the logits the sampler reads
    for block k equal those of the training forward over [x_t ; x_0] under the block-diffusion mask."""
    model = build()
    length, k = 12, 2
    clean = torch.randint(0, EOS_ID, (1, length), generator=torch.Generator().manual_seed(3))
    noisy = clean.clone()
    noisy[0, k * B + 1:] = MASK_ID                      # block k half denoised, later blocks untouched
    # The sampler's view (no cache): the committed prefix and block k, block-causal.
    view = noisy[:, :(k + 1) * B]
    positions = torch.arange(view.shape[1])[None]
    causal_blocks = (positions[0, None, :] // B <= positions[0, :, None] // B)[None]
    sampled = model.inference_forward(view, positions, causal_blocks)[:, k * B:(k + 1) * B]
    # Training's view: [x_t ; x_0] of the whole row, x_0 the committed clean tokens.
    x_t = torch.full_like(clean, MASK_ID)
    x_t[0, :(k + 1) * B] = noisy[0, :(k + 1) * B]
    both = torch.cat([x_t, clean], dim=1)
    mask = AttentionMask("block_diffusion", block_size=B, noisy_length=length).dense(2 * length)[:, 0]
    trained = model.inference_forward(both, torch.arange(length).repeat(2)[None], mask)[:, k * B:(k + 1) * B]
    torch.testing.assert_close(sampled, trained, rtol=1e-5, atol=1e-5)


def test_block_length_other_than_the_models_blocks_is_refused():
    with pytest.raises(ValueError, match="block size 4 the block-diffusion model was trained with"):
        build().generate(torch.stack(prompts([4])), gen_length=8, block_length=8)


@pytest.mark.parametrize("ar_loss_weight", [0.0, 1.0])
def test_the_hf_export_generates_and_reads_like_our_model_and_imports_back(tmp_path, ar_loss_weight):
    """A joint AR + DLM model's export (ar_loss_weight > 0) also reads its input causally and decodes
    autoregressively, as ours."""
    pytest.importorskip("transformers")
    from megatron.core.transformer.transformer_config import DLMConfig as OurDLMConfig
    from tests.unit_tests.test_hf_conversion import VOCAB as HF_VOCAB, export, load_hf, save_checkpoint, tiny_config
    from megatron.training.checkpoint_files import configs_from_metadata, inference_metadata
    from tools.weights_conversion import hf_to_megatron

    dlm = OurDLMConfig(model_running_mode="difflm-noshift", block_diffusion=True, block_size=B,
                       mask_token_id=HF_VOCAB - 1, ar_loss_weight=ar_loss_weight)
    model = save_checkpoint(tmp_path / "ckpt", tiny_config(qk_layernorm=True, init_method_std=0.5), dlm)
    config = export(tmp_path / "ckpt", tmp_path / "hf")
    assert config["attention_mask_type"] == "block_diffusion" and config["attention_block_size"] == B
    assert config["ar_loss_weight"] == ar_loss_weight
    hf = load_hf(tmp_path / "hf")
    prompt = torch.randint(0, HF_VOCAB - 1, (2, 6), generator=torch.Generator().manual_seed(2))
    for cache in (None, "prefix"):
        ours = model.generate(prompt, gen_length=9, cache=cache)
        assert torch.equal(hf.generate(prompt, gen_length=9, cache=cache), ours), cache
    if ar_loss_weight:
        ours = model.generate(prompt, gen_length=5, autoregressive=True)
        assert torch.equal(hf.generate(prompt, gen_length=5, autoregressive=True), ours)
    # A plain forward reads its ids as clean blocks (block-causal; causal for a joint model), ours and the HF one.
    batch = torch.randint(0, HF_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits, theirs_logits = model(batch)[..., :HF_VOCAB], hf(input_ids=batch).logits
    positions = torch.arange(12)
    blocks = (positions[None, :] // B <= positions[:, None] // B).expand(2, 12, 12)
    if ar_loss_weight:
        blocks = (positions[None, :] <= positions[:, None]).expand(2, 12, 12)
    plain = model.inference_forward(batch, positions.expand(2, 12), blocks)[..., :HF_VOCAB]
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_logits, plain, rtol=0, atol=1e-5)
    # Scoring (test_likelihood.py checks the block-wise ELBO itself): the export's equals ours.
    context, answer = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8, 9])
    scores = [m.log_likelihood(context, answer, mc_num=8, batch_size=8, generator=torch.Generator().manual_seed(4))
              for m in (model, hf)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-4)
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "back"),
                                "--no-progress"]) == 0
    _, back = configs_from_metadata(inference_metadata(str(tmp_path / "back")))
    assert back.block_diffusion and back.block_size == B and back.ar_loss_weight == ar_loss_weight


def test_dlm_inference_with_the_cache_prints_what_it_prints_without(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    from megatron.core.transformer.transformer_config import DLMConfig as OurDLMConfig
    from tests.unit_tests.test_hf_conversion import VOCAB as HF_VOCAB, save_checkpoint, tiny_config

    dlm = OurDLMConfig(model_running_mode="difflm-noshift", block_diffusion=True, block_size=B,
                       mask_token_id=HF_VOCAB - 1)
    save_checkpoint(tmp_path / "ckpt", tiny_config(qk_layernorm=True, init_method_std=0.5), dlm)
    script = Path(__file__).resolve().parents[2] / "examples" / "dlm_generation" / "dlm_inference.py"
    spec = importlib.util.spec_from_file_location("dlm_inference", script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    printed = []
    for cache in ([], ["--cache", "prefix"]):
        argv = ["--load", str(tmp_path / "ckpt"), "--prompt", "5 6 7 8 9 10", "--max-new-tokens", "11",
                "--device", "cpu", *cache]
        assert tool.main(argv) == 0
        printed.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("generated:")])
    assert printed[0] == printed[1] and len(printed[0]) == 1
    assert tool.main(["--load", str(tmp_path / "ckpt"), "--prompt", "5 6", "--inference-block-size", "8"]) != 0
    assert "block-diffusion model samples by the blocks" in capsys.readouterr().err


def test_generation_of_any_length_stops_at_eos_after_its_block():
    from megatron.core.inference.generation import generate
    from tests.unit_tests.test_generation import scripted_model

    prompt = torch.tensor([[5, 6, 7]])
    targets = torch.full((1, 43), 20)
    targets[0, 3 + 5] = EOS_ID                 # in the model's second block (positions 4..7 hold 1..4)
    model_fn, calls = scripted_model(targets, torch.linspace(9.0, 5.0, 43))
    out = generate(model_fn, prompt, running_mode="difflm-noshift", mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                   pad_token_id=0, gen_length=40, attention_mask_type="block_diffusion", attention_block_size=B,
                   cache="prefix")
    assert out[0, 3:10].tolist() == [20, 20, 20, 20, 20, EOS_ID, 0] and (out[0, 9:] == 0).all()
    # One token a step: the first block's slot, then the 4 slots of the block holding EOS; no more.
    assert len(calls) == 1 + 4 + 1 and max(call.shape[1] for call in calls[1:]) <= 2 * B
