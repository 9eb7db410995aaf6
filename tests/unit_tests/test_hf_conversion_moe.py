"""tools/weights_conversion with mixture-of-experts models, checked by logits.

Tiny fp32 models built in this process: transformers' own Qwen3MoeForCausalLM (a dense layer
among MoE ones, renormalised top-k) and OlmoeForCausalLM (full-width QK-norm, softmax over all
experts before the top-k), imported, compared with our model, exported back; an import of
transformers 5's fused expert layout; and MoE DLM checkpoints of our GPTModel (shared expert,
biases, sigmoid scores with an expert bias, expert choice, capacity limits) exported with the
remote code, loaded with trust_remote_code, compared and generated with.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron.core.dist_checkpointing import serialization  # noqa: E402
from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.moe.config import MoEConfig  # noqa: E402
from megatron.core.transformer.transformer_config import DLMConfig  # noqa: E402
from tests.unit_tests.test_hf_conversion import (VOCAB, assert_round_trip, export, ids, load_hf,  # noqa: E402
                                              perturb, replace_tensor, tiny_config)
from tools.weights_conversion import checkpoint_io, hf_to_megatron, megatron_to_hf  # noqa: E402

TOLERANCE = 1e-4


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    difference = (ours - theirs).abs().max().item()
    assert difference <= TOLERANCE, f"max abs logit difference {difference:.3e}"


def safetensors_of(folder: Path) -> dict:
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors


# ------------------------------------------------------------------------------ HF -> ours -> HF
def random_hf_moe(kind: str, path: Path, **changes):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rope_theta=20000.0, rms_norm_eps=1e-5, num_experts=4,
                  num_experts_per_tok=2)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_hidden_layers=3, head_dim=8, intermediate_size=48,
                                             moe_intermediate_size=16, mlp_only_layers=[1], norm_topk_prob=True,
                                             tie_word_embeddings=False, **{**common, **changes})
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.OlmoeConfig(num_hidden_layers=2, intermediate_size=16, norm_topk_prob=False,
                                          tie_word_embeddings=True, **{**common, **changes})
        model_class = transformers.OlmoeForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    perturb(model)
    model.save_pretrained(str(path), max_shard_size="40KB")
    return model


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_hf_moe_to_ours_to_hf(kind, tmp_path):
    original = random_hf_moe(kind, tmp_path / "hf")
    written = safetensors_of(tmp_path / "hf")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in written  # save_pretrained's per-expert layout
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    ours, metadata, _ = checkpoint_io.load_model(str(tmp_path / "ckpt"))
    saved, moe = metadata["transformer_config"], metadata["transformer_config"]["moe"]
    assert moe["num_experts"] == 4 and moe["router_topk"] == 2 and moe["ffn_hidden_size"] == 16
    assert moe["layer_freq"] == ([1, 0, 1] if kind == "qwen3_moe" else [1, 1])
    assert moe["router_pre_softmax"] == (kind == "olmoe")  # norm_topk_prob False: no renormalisation
    assert saved["qk_layernorm"] and saved["qk_layernorm_scope"] == ("all" if kind == "olmoe" else "head")
    assert_round_trip(original, ours, tmp_path, assert_close)
    exported = safetensors_of(tmp_path / "back")
    assert set(exported) == set(written)  # the per-expert layout, as save_pretrained wrote it
    for name, tensor in written.items():
        assert torch.equal(exported[name], tensor), name


def test_import_reads_the_fused_expert_layout_of_transformers_5(tmp_path):
    """transformers 5 holds the experts fused (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]);
    a folder written in that layout imports to the same model."""
    original = random_hf_moe("qwen3_moe", tmp_path / "hf")
    fused = {name: tensor.contiguous() for name, tensor in original.state_dict().items()}
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    for path in (tmp_path / "hf").glob("model*.safetensors*"):
        path.unlink()
    save_file(fused, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    ours, _, _ = checkpoint_io.load_model(str(tmp_path / "ckpt"))
    tokens = ids()
    with torch.no_grad():
        assert_close(ours(tokens), original(tokens).logits)


# ------------------------------------------------------------------------------ ours (MoE DLM) -> HF
def save_moe_checkpoint(root: Path, config, dlm: DLMConfig):
    """A checkpoint as training writes it, with norms, biases and expert biases away from their init."""
    torch.manual_seed(0)
    model = GPTModel(config, dlm)
    perturb(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
        for name, param in model.named_parameters():
            if name.endswith("router.weight"):  # decisive routing: no near-ties between experts
                param.mul_(10.0)
    target = root / "iter_0000003"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        serialization.save(model.sharded_state_dict(prefix="model."), str(target))
    metadata = checkpoint_io.metadata_for(config, dlm, 1, None, 32, {}, iteration=3)
    (target / "metadata.json").write_text(json.dumps(metadata))
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return model.eval()


DIFFUSION = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=VOCAB - 1)
DLM_CASES = {
    # name: (TransformerConfig changes, MoEConfig, DLMConfig)
    "shared_expert_biases_sigmoid_expert_bias": (
        dict(add_bias_linear=True, qk_layernorm=True, qk_layernorm_scope="all", normalization="LayerNorm"),
        MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16, shared_expert_intermediate_size=8,
                  layer_freq=[1, 0], router_score_function="sigmoid", router_enable_expert_bias=True,
                  router_topk_scaling_factor=1.5),
        DIFFUSION),
    "expert_choice": (dict(qk_layernorm=True),
                      MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16, router_type="expert_choice",
                                expert_capacity_factor=1.5),
                      DIFFUSION),
    "vanilla_capacity_pre_softmax": (dict(qk_layernorm=True),
                                     MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16,
                                               router_pre_softmax=True, expert_capacity_factor=0.75),
                                     DLMConfig(model_running_mode="vanilla")),
}


@pytest.mark.parametrize("case", sorted(DLM_CASES))
def test_moe_dlm_export_loads_with_remote_code_and_round_trips(case, tmp_path):
    changes, moe, dlm = DLM_CASES[case]
    model = save_moe_checkpoint(tmp_path / "ckpt", tiny_config(moe=moe, **changes), dlm)
    hf_config = export(tmp_path / "ckpt", tmp_path / "hf")
    assert hf_config["architectures"] == ["DLMForCausalLM"] and hf_config["num_experts"] == 4
    assert hf_config["moe_layer_flags"] == moe.layer_flags
    hf = load_hf(tmp_path / "hf")
    tokens = ids()
    with torch.no_grad():
        assert_close(model(tokens)[..., :VOCAB], hf(tokens).logits)
    # ... and back: the same tensors, the same MoE configuration.
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "back")]) == 0
    _, metadata, iter_dir = checkpoint_io.load_model(str(tmp_path / "back"))
    assert metadata["transformer_config"]["moe"] == json.loads(json.dumps(checkpoint_io.metadata_for(
        tiny_config(moe=moe, **changes), dlm, 1, None, None, {})["transformer_config"]["moe"]))
    before = checkpoint_io.read_tensors(str(tmp_path / "ckpt" / "iter_0000003"),
                                        list(checkpoint_io.stored_shapes(str(tmp_path / "ckpt" / "iter_0000003"))))
    after = checkpoint_io.read_tensors(iter_dir, list(checkpoint_io.stored_shapes(iter_dir)))
    assert set(before) == set(after)
    for name, tensor in before.items():
        rows = VOCAB if name.startswith(("embedding.", "output_layer.")) else tensor.shape[0]
        assert torch.equal(tensor[:rows], after[name][:rows]), name


def test_moe_dlm_export_generates_like_our_model(tmp_path):
    """The sampler through the exported MoE model (expert choice, with and without the KV cache)
    returns our model's tokens."""
    changes, moe, dlm = DLM_CASES["expert_choice"]
    model = save_moe_checkpoint(tmp_path / "ckpt", tiny_config(moe=moe, **changes), dlm)
    export(tmp_path / "ckpt", tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    prompt = ids(batch=2, seq=6, vocab=VOCAB - 1)
    for options in (dict(steps=8, block_length=4), dict(steps=8, block_length=4, cache="dual")):
        ours = model.generate(prompt, gen_length=8, eos_token_id=None, **options)
        theirs = hf.generate(prompt, gen_length=8, eos_token_id=None, **options)
        assert theirs.shape == (2, 14) and torch.equal(ours, theirs), options


# ------------------------------------------------------------------------------ choices and bad input
def test_native_moe_export_is_chosen_only_when_it_computes_the_same(tmp_path, capsys):
    vanilla = DLMConfig(model_running_mode="vanilla")
    qwen3_moe = tiny_config(qk_layernorm=True, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16))
    save_moe_checkpoint(tmp_path / "plain", qwen3_moe, vanilla)
    assert export(tmp_path / "plain", tmp_path / "native")["architectures"] == ["Qwen3MoeForCausalLM"]
    assert megatron_to_hf.main(["--load", str(tmp_path / "plain"), "--save", str(tmp_path / "x"),
                                "--hf-architecture", "olmoe", "--no-progress"]) == 1
    assert "qk_layernorm_scope=all" in capsys.readouterr().err
    biased = qwen3_moe.replace(moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16,
                                             router_score_function="sigmoid", router_enable_expert_bias=True))
    save_moe_checkpoint(tmp_path / "biased", biased, vanilla)
    assert megatron_to_hf.main(["--load", str(tmp_path / "biased"), "--save", str(tmp_path / "x"),
                                "--hf-architecture", "qwen3_moe", "--no-progress"]) == 1
    assert "expert bias" in capsys.readouterr().err
    assert export(tmp_path / "biased", tmp_path / "remote")["architectures"] == ["DLMForCausalLM"]


def test_olmoe_with_qkv_clipping_is_refused(tmp_path, capsys):
    random_hf_moe("olmoe", tmp_path / "hf", clip_qkv=8.0)
    capsys.readouterr()  # save_pretrained's progress bar
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "clip_qkv" in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_an_expert_tensor_of_the_wrong_shape_is_named(tmp_path, capsys):
    random_hf_moe("qwen3_moe", tmp_path / "hf")
    name = "model.layers.2.mlp.experts.1.up_proj.weight"
    replace_tensor(tmp_path / "hf", name, torch.zeros(24, 32))
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 1
    error = capsys.readouterr().err
    assert name in error and "(24, 32)" in error and "(16, 32)" in error
