"""gguf_to_hf.py: a GGUF written from a known Llama gives back that Llama's weights and logits."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is a dev dependency (setup.py)")
transformers = pytest.importorskip("transformers")

from tools.weights_conversion import gguf_to_hf  # noqa: E402

# A byte-level BPE vocabulary that spells "ab ba": the special token, the pieces, one merge.
TOKENS = ["<|endoftext|>", "a", "b", "Ġ", "ab", "Ġb", "Ġba", "ba"]
MERGES = ["a b", "Ġ b", "b a", "Ġb a"]


def _llama(seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def _interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k: each head's rotary halves interleaved (GGUF stores them so)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _tensors(model) -> dict:
    config, state = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf, ours in names.items():
            out[f"blk.{layer}.{ours}.weight"] = state[prefix + hf + ".weight"]
        out[f"blk.{layer}.attn_q.weight"] = _interleave(state[prefix + "self_attn.q_proj.weight"],
                                                        config.num_attention_heads)
        out[f"blk.{layer}.attn_k.weight"] = _interleave(state[prefix + "self_attn.k_proj.weight"],
                                                        config.num_key_value_heads)
    return out


def write_gguf(model, path: str, eos: int = 0) -> None:
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(TOKENS) - 1))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(eos)
    for name, tensor in _tensors(model).items():
        writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_llama_becomes_the_same_hugging_face_llama(tmp_path):
    model = _llama()
    write_gguf(model, str(tmp_path / "tiny.gguf"))
    save = tmp_path / "hf"
    assert gguf_to_hf.main(["--gguf", str(tmp_path / "tiny.gguf"), "--save", str(save)]) == 0
    config = json.loads((save / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(save)).eval()
    for name, tensor in model.state_dict().items():  # q/k rows back in Hugging Face's order
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(save))
    ids = tokenizer("ab ba", return_tensors="pt").input_ids
    assert tokenizer.convert_ids_to_tokens(ids[0].tolist()) == ["ab", "Ġba"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_bad_input_is_one_line_and_an_earlier_folder_survives(tmp_path, capsys):
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip, not GGUF")
    earlier = tmp_path / "hf"
    earlier.mkdir()
    (earlier / "config.json").write_text('{"model_type": "llama"}')
    assert gguf_to_hf.main(["--gguf", str(tmp_path / "not.gguf"), "--save", str(earlier)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not a GGUF file" in error and "Traceback" not in error
    assert gguf_to_hf.main(["--gguf", str(tmp_path / "missing.gguf"), "--save", str(earlier)]) == 1
    assert "no such file" in capsys.readouterr().err
    assert (earlier / "config.json").read_text() == '{"model_type": "llama"}'
    assert sorted(os.listdir(tmp_path)) == ["hf", "not.gguf"]  # no staging folder left behind


def test_the_special_tokens_are_the_ones_the_file_names(tmp_path, monkeypatch, capsys):
    """Whatever eos a transformers version derives, the folder's is the GGUF's (training pads with it)."""
    write_gguf(_llama(), str(tmp_path / "tiny.gguf"), eos=7)
    read = gguf_to_hf.read_gguf

    def other_version(path, dtype):  # a transformers that picks the bos as eos
        model, tokenizer = read(path, dtype)
        tokenizer.eos_token = TOKENS[0]
        model.config.eos_token_id = 0
        return model, tokenizer

    monkeypatch.setattr(gguf_to_hf, "read_gguf", other_version)
    assert gguf_to_hf.main(["--gguf", str(tmp_path / "tiny.gguf"), "--save", str(tmp_path / "hf")]) == 0
    assert "note: eos_token 'ba' (id 7)" in capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer.eos_token == "ba" and tokenizer.eos_token_id == 7 and tokenizer.bos_token_id == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 7
