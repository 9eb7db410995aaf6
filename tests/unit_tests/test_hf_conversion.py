"""tools/weights_conversion: MegaDLMs checkpoints <-> Hugging Face folders, checked by logits.

Every test builds tiny fp32 models in this process: our GPTModel saved as a checkpoint, or a
randomly initialised transformers Llama/Qwen2/Qwen3. Norm weights and biases are perturbed away
from their init so a swapped or dropped tensor changes the logits. The TP=2 training-run round
trip is in tests/distributed/test_hf_conversion_tp.py.
"""

import gzip
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron.core.dist_checkpointing import serialization  # noqa: E402
from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig  # noqa: E402
from megatron.training.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer  # noqa: E402
from tools.weights_conversion import checkpoint_io, hf_to_megatron, megatron_to_hf  # noqa: E402
from tools.weights_conversion import verify_correctness_dlm  # noqa: E402
from tools.weights_conversion.tokenizer_export import spm_to_tokenizers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPM = str(ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model")
VOCAB, PADDED = 90, 96  # the checkpoint holds padded rows; exports keep the first VOCAB
TOLERANCE = 1e-5


def perturb(model: torch.nn.Module, seed: int = 7) -> None:
    """Norm weights and biases away from 1 / 0, so every tensor matters to the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def tiny_config(**changes) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                vocab_size=PADDED, unpadded_vocab_size=VOCAB, max_position_embeddings=64, rotary_base=50000.0,
                layernorm_epsilon=1e-5, attention_backend="math")
    base.update(changes)
    return TransformerConfig(**base)


def save_checkpoint(root: Path, config: TransformerConfig, dlm: DLMConfig, tokenizer=None, iteration=3):
    """A checkpoint as training writes it (DCP model shards, metadata.json, tracker); returns the model."""
    torch.manual_seed(0)
    model = GPTModel(config, dlm)
    perturb(model)
    target = root / f"iter_{iteration:07d}"
    with warnings.catch_warnings():  # DCP notes it runs without a process group: intended
        warnings.simplefilter("ignore")
        serialization.save(model.sharded_state_dict(prefix="model."), str(target))
    metadata = checkpoint_io.metadata_for(config, dlm, 1, tokenizer, 32, {}, iteration=iteration)
    (target / "metadata.json").write_text(json.dumps(metadata))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return model.eval()


def export(ckpt: Path, out: Path, *extra) -> dict:
    assert megatron_to_hf.main(["--load", str(ckpt), "--save", str(out), "--dtype", "float32", "--no-progress",
                                *extra]) == 0
    return json.loads((out / "config.json").read_text())


def load_hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True,
                                                             dtype=torch.float32).eval()


def ids(batch=2, seq=16, vocab=VOCAB, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_logits_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    difference = (ours - theirs).abs().max().item()
    assert difference <= TOLERANCE, f"max abs logit difference {difference:.3e}"


# ------------------------------------------------------------------------------ ours -> HF
EXPORT_CASES = {
    # name: (TransformerConfig changes, DLMConfig, expected class)
    "llama_gqa_untied": (dict(share_embeddings_and_output_weights=False, kv_channels=16),
                         DLMConfig(model_running_mode="vanilla"), "LlamaForCausalLM"),
    "qwen3_qknorm_tied": (dict(qk_layernorm=True), DLMConfig(model_running_mode="vanilla"), "Qwen3ForCausalLM"),
    "qwen2_qkv_bias": (dict(add_qkv_bias=True, share_embeddings_and_output_weights=False),
                       DLMConfig(model_running_mode="vanilla"), "Qwen2ForCausalLM"),
    "dlm_shift_qknorm_bias_untied": (dict(qk_layernorm=True, add_qkv_bias=True,
                                          share_embeddings_and_output_weights=False),
                                     DLMConfig(model_running_mode="difflm-shift", mask_token_id=VOCAB - 1),
                                     "DLMForCausalLM"),
    "dlm_layernorm_gelu_block_causal": (dict(normalization="LayerNorm", gated_linear_unit=False, activation="gelu",
                                             add_bias_linear=True, rotary_percent=0.5, num_query_groups=4),
                                        DLMConfig(model_running_mode="difflm-noshift", mask_token_id=VOCAB - 1,
                                                  attention_mask_type="block_causal", block_size=4),
                                        "DLMForCausalLM"),
    "vanilla_layernorm_remote_causal": (dict(normalization="LayerNorm", qk_layernorm=True),
                                        DLMConfig(model_running_mode="vanilla"), "DLMForCausalLM"),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_loads_in_transformers_with_our_logits(case, tmp_path):
    changes, dlm, expected_class = EXPORT_CASES[case]
    config = tiny_config(**changes)
    model = save_checkpoint(tmp_path / "ckpt", config, dlm)
    hf_config = export(tmp_path / "ckpt", tmp_path / "hf")
    assert hf_config["architectures"] == [expected_class]
    assert (tmp_path / "hf" / "modeling_dlm.py").exists() == (expected_class == "DLMForCausalLM")
    assert hf_config["vocab_size"] == VOCAB and hf_config["rope_theta"] == 50000.0
    assert hf_config["rms_norm_eps"] == 1e-5 and hf_config["num_key_value_heads"] == config.num_query_groups
    assert hf_config["tie_word_embeddings"] == config.share_embeddings_and_output_weights
    hf = load_hf(tmp_path / "hf")
    assert type(hf).__name__ == expected_class
    tokens = ids()
    with torch.no_grad():
        assert_logits_equal(model(tokens)[..., :VOCAB], hf(tokens).logits)
    if expected_class == "DLMForCausalLM":
        assert hf.config.model_running_mode == dlm.model_running_mode
        assert hf.config.attention_mask_type == dlm.effective_mask_type
        assert hf.config.mask_token_id == dlm.mask_token_id


def test_export_respects_padding_and_left_padded_positions(tmp_path):
    """The remote-code model never attends to padding: a left-padded row gives the logits of the
    same tokens run alone (bidirectional, so this fails if padded keys leak in)."""
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=VOCAB - 1)
    save_checkpoint(tmp_path / "ckpt", tiny_config(qk_layernorm=True), dlm)
    export(tmp_path / "ckpt", tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    alone = ids(batch=1, seq=10)
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), alone], dim=1)
    real = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], dim=1)
    with torch.no_grad():
        expected = hf(alone).logits
        assert_logits_equal(hf(padded, attention_mask=real).logits[:, 6:], expected)
        assert (hf(padded).logits[:, 6:] - expected).abs().max() > 1e-3  # the check has teeth


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift", "vanilla"])
def test_export_generates_like_our_model(mode, tmp_path):
    """HF generate (the sampler through dlm_forward, with and without the KV cache) returns the
    tokens our model's generate returns, and HF log_likelihood our score."""
    pytest.importorskip("megatron.core.inference.generation")
    dlm = DLMConfig(model_running_mode=mode, mask_token_id=VOCAB - 1 if mode != "vanilla" else None)
    model = save_checkpoint(tmp_path / "ckpt", tiny_config(qk_layernorm=True, normalization="LayerNorm"), dlm)
    export(tmp_path / "ckpt", tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    prompt = ids(batch=2, seq=6, vocab=VOCAB - 1)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding in the second row
    runs = [dict(use_cache=True), dict(use_cache=False)] if mode == "vanilla" else [
        dict(steps=8, block_length=4), dict(steps=8, block_length=4, cache="dual")]
    for options in runs:
        ours = model.generate(prompt, mask, gen_length=8, eos_token_id=None, **options)
        theirs = hf.generate(prompt, attention_mask=mask, gen_length=8, eos_token_id=None, **options)
        assert torch.equal(ours, theirs), options
    # The answer score (likelihood.py ships with the export): the same estimate from the same seed.
    scores = [scorer.log_likelihood(prompt[0, :4], prompt[0, 4:], mc_num=8, batch_size=4,
                                    generator=torch.Generator().manual_seed(5)) for scorer in (model, hf)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-4) and scores[0] < 0


def exported_dlm(tmp_path):
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=VOCAB - 1)
    save_checkpoint(tmp_path / "ckpt", tiny_config(qk_layernorm=True), dlm)
    export(tmp_path / "ckpt", tmp_path / "hf")
    assert (tmp_path / "hf" / "cuda_graphs.py").exists()
    return load_hf(tmp_path / "hf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_export_with_cuda_graphs_says_it_needs_cuda(tmp_path):
    hf = exported_dlm(tmp_path)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        hf.generate(ids(batch=1, seq=4, vocab=VOCAB - 1), gen_length=4, steps=4, cuda_graphs=True)


@pytest.mark.gpu
def test_export_generates_with_cuda_graphs_as_without(tmp_path):
    """The exported model's generate(cuda_graphs=True) (cuda_graphs.py shipped with it) returns
    its eager tokens, with and without the KV cache, and replays on the second call."""
    hf = exported_dlm(tmp_path).cuda()
    prompt = ids(batch=2, seq=6, vocab=VOCAB - 1).cuda()
    for options in (dict(steps=8, block_length=4), dict(steps=8, block_length=4, cache="dual")):
        expected = hf.generate(prompt, gen_length=8, eos_token_id=None, **options)
        for _ in range(2):
            assert torch.equal(hf.generate(prompt, gen_length=8, eos_token_id=None, cuda_graphs=True, **options),
                               expected), options
    assert hf._graph_runner.replays > 0


def test_sharded_export_and_forced_architecture(tmp_path):
    config = tiny_config(share_embeddings_and_output_weights=False)
    save_checkpoint(tmp_path / "ckpt", config, DLMConfig(model_running_mode="vanilla"))
    export(tmp_path / "ckpt", tmp_path / "hf", "--max-shard-size", "20KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / "hf" / name).exists() for name in files)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert type(load_hf(tmp_path / "hf")).__name__ == "LlamaForCausalLM"
    # Llama cannot hold QK-norm: forcing it is an error that says why; dlm is always possible.
    save_checkpoint(tmp_path / "qk", tiny_config(qk_layernorm=True), DLMConfig(model_running_mode="vanilla"))
    assert megatron_to_hf.main(["--load", str(tmp_path / "qk"), "--save", str(tmp_path / "bad"),
                                "--hf-architecture", "llama", "--no-progress"]) == 1
    assert export(tmp_path / "qk", tmp_path / "forced", "--hf-architecture", "dlm")["architectures"] == [
        "DLMForCausalLM"]


# ------------------------------------------------------------------------------ HF -> ours -> HF
def random_hf_model(kind: str, path: Path):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=20000.0, rms_norm_eps=1e-5)
    if kind == "llama":
        config = transformers.LlamaConfig(head_dim=16, tie_word_embeddings=False, **common)
        model_class = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(tie_word_embeddings=False, **common)
        model_class = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(head_dim=8, tie_word_embeddings=True, **common)
        model_class = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    perturb(model)
    model.save_pretrained(str(path), max_shard_size="30KB")  # sharded: exercises the index reader
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_hf_to_ours_to_hf(kind, tmp_path):
    original = random_hf_model(kind, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    ours, metadata, _ = checkpoint_io.load_model(str(tmp_path / "ckpt"))
    assert metadata["dlm_config"]["model_running_mode"] == "vanilla"
    assert metadata["transformer_config"]["rotary_base"] == 20000.0
    assert metadata["transformer_config"]["qk_layernorm"] == (kind == "qwen3")
    assert_round_trip(original, ours, tmp_path, assert_logits_equal)
    saved = {}
    for name in os.listdir(tmp_path / "back"):
        if name.endswith(".safetensors"):
            saved.update(load_file(str(tmp_path / "back" / name)))
    expected = {name: tensor for name, tensor in original.state_dict().items()
                if not (original.config.tie_word_embeddings and name == "lm_head.weight")}
    assert set(saved) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor), name


def test_hf_to_dlm_adaptation_records_the_objective(tmp_path):
    random_hf_model("qwen3", tmp_path / "hf")
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                                "--model-running-mode", "difflm-shift", "--mask-token-id", str(VOCAB - 1)]) == 0
    ours, metadata, _ = checkpoint_io.load_model(str(tmp_path / "ckpt"))
    assert ours.running_mode == "difflm-shift" and ours.dlm_config.mask_token_id == VOCAB - 1
    assert metadata["iteration"] == 0 and (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "0"
    # difflm modes need a mask token: without one (and no tokenizer to find it) the error says so.
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "nomask"),
                                "--model-running-mode", "difflm-noshift"]) == 1


# ------------------------------------------------------------------------------ bad input
def test_unsupported_architecture_lists_the_supported_ones(tmp_path, capsys):
    random_hf_model("llama", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 1
    error = capsys.readouterr().err
    assert "GPT2LMHeadModel" in error
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DLMForCausalLM"):
        assert supported in error
    scaled = {**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(scaled))
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 1
    assert "llama3" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def assert_round_trip(original, ours, tmp_path, compare) -> None:
    """`ours` (imported from `original`) and the export of tmp_path/ckpt to tmp_path/back, loaded
    back as `original`'s class: both give `original`'s logits on the same ids (`compare`)."""
    tokens = ids()
    with torch.no_grad():
        reference = original(tokens).logits
        compare(ours(tokens), reference)
        export(tmp_path / "ckpt", tmp_path / "back")
        back = load_hf(tmp_path / "back")
        assert type(back) is type(original)
        compare(back(tokens).logits, reference)


def replace_tensor(hf_dir, name: str, tensor: torch.Tensor) -> None:
    """Overwrite tensor `name` of a sharded HF folder in its shard."""
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shard = str(hf_dir / index["weight_map"][name])
    tensors = load_file(shard)
    tensors[name] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, capsys):
    random_hf_model("llama", tmp_path / "hf")
    name = "model.layers.1.self_attn.k_proj.weight"
    replace_tensor(tmp_path / "hf", name, torch.zeros(24, 32))  # 3 kv heads of 8 instead of 2 of 16
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 1
    error = capsys.readouterr().err
    assert name in error and "(24, 32)" in error and "(32, 32)" in error


# ------------------------------------------------------------------------------ tokenizer and verification
def spm_identity():
    tokenizer = SentencePieceTokenizer(SPM)
    return tokenizer, tokenizer.identity


def test_spm_tokenizer_export_encodes_like_sentencepiece(tmp_path):
    tokenizer, identity = spm_identity()
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=tokenizer.mask)
    config = tiny_config(vocab_size=8192, unpadded_vocab_size=8192)
    # An older checkpoint, whose identity does not record the tokenizer's files...
    identity = {key: value for key, value in identity.items() if key != "files"}
    save_checkpoint(tmp_path / "ckpt", config, dlm, tokenizer=identity)
    # ...the export asks for them...
    assert megatron_to_hf.main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "x"), "--no-progress"]) == 1
    # ...and refuses a file with another hash.
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(SPM).read_bytes())
    proto.pieces[300].score += 0.5  # a valid model, another tokenizer
    other = tmp_path / "other.model"
    other.write_bytes(proto.SerializeToString())
    assert megatron_to_hf.main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "x"), "--no-progress",
                                "--tokenizer-model", str(other)]) == 1
    hf_config = export(tmp_path / "ckpt", tmp_path / "hf", "--tokenizer-model", SPM)
    assert hf_config["eos_token_id"] == tokenizer.eod and hf_config["mask_token_id"] == tokenizer.mask
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == Path(SPM).read_bytes()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    assert hf_tokenizer.mask_token_id == tokenizer.mask and hf_tokenizer.eos_token_id == tokenizer.eod
    with gzip.open(ROOT / "examples" / "data" / "sotu_1790_1928.jsonl.gz", "rt") as handle:
        texts = [json.loads(next(handle))["text"][:20000] for _ in range(3)]
    for text in texts + ["  two leading spaces,\ttabs\n\nand digits 1234.5 naïve 東京 🙂", " x", ""]:
        expected = tokenizer.tokenize(text)
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == expected, text[:40]
        assert hf_tokenizer.decode(expected) == text


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer"])
def test_bpe_tokenizer_export_with_an_appended_mask_token(kind, tmp_path):
    from tests.unit_tests.test_tokenizers import CORPUS, save_gpt2, save_hf

    if kind == "HuggingFaceTokenizer":
        paths = {"tokenizer_model": str(save_hf(tmp_path / "tok"))}
        flags = ["--tokenizer-model", paths["tokenizer_model"]]
        tokenizer = HuggingFaceTokenizer(paths["tokenizer_model"], add_mask_token=True)
    else:
        vocab, merges = save_gpt2(tmp_path / "tok")
        flags = ["--vocab-file", vocab, "--merge-file", merges]
        tokenizer = GPT2BPETokenizer(vocab, merges, add_mask_token=True)
    assert tokenizer.mask_is_added
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=tokenizer.mask)
    config = tiny_config(vocab_size=512, unpadded_vocab_size=tokenizer.vocab_size)
    save_checkpoint(tmp_path / "ckpt", config, dlm, tokenizer=tokenizer.identity)
    export(tmp_path / "ckpt", tmp_path / "hf", *flags)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    assert hf_tokenizer.mask_token_id == tokenizer.mask == tokenizer.vocab_size - 1
    assert hf_tokenizer.eos_token_id == tokenizer.eod
    for text in CORPUS[:5]:
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.tokenize(text)


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"])
def test_tokenizer_export_finds_the_files_the_identity_records(kind, tmp_path):
    """Training records the tokenizer's absolute paths: the export needs no tokenizer flag."""
    from tests.unit_tests.test_tokenizers import save_gpt2, save_hf

    if kind == "SentencePieceTokenizer":
        tokenizer = SentencePieceTokenizer(SPM)
    elif kind == "HuggingFaceTokenizer":  # a folder with config files: several files, one folder
        folder = save_hf(tmp_path / "tok", configs={"tokenizer_config.json": {"eos_token": "<|endoftext|>"}})
        tokenizer = HuggingFaceTokenizer(str(folder), add_mask_token=True)
    else:
        tokenizer = GPT2BPETokenizer(*save_gpt2(tmp_path / "tok"), add_mask_token=True)
    identity = tokenizer.identity
    assert identity["files"] and all(os.path.isabs(path) for path in identity["files"])
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=tokenizer.mask)
    vocab = tokenizer.vocab_size
    save_checkpoint(tmp_path / "ckpt", tiny_config(vocab_size=vocab, unpadded_vocab_size=vocab), dlm,
                    tokenizer=identity)
    hf_config = export(tmp_path / "ckpt", tmp_path / "hf")  # no --tokenizer-model / --vocab-file
    assert hf_config["mask_token_id"] == tokenizer.mask and hf_config["eos_token_id"] == tokenizer.eod
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    text = "Fellow-Citizens of the Senate and House of Representatives"
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.tokenize(text)


def test_spm_merges_replay_sentencepiece_priorities():
    """SentencePiece BPE merges the pair forming the highest-scored piece first: the first merge of
    the exported pipeline forms the first learned piece of the model."""
    from sentencepiece import SentencePieceProcessor

    processor = SentencePieceProcessor(model_file=SPM)
    first_learned = next(processor.id_to_piece(i) for i in range(processor.get_piece_size())
                         if not (processor.is_control(i) or processor.is_byte(i) or processor.is_unknown(i))
                         and len(processor.id_to_piece(i)) > 1)
    merge = json.loads(spm_to_tokenizers(SPM).to_str())["model"]["merges"][0]
    pair = merge if isinstance(merge, list) else merge.split(" ")
    assert "".join(pair) == first_learned


def test_verify_correctness_passes_a_good_export_and_fails_a_perturbed_one(tmp_path, capsys):
    tokenizer, identity = spm_identity()
    dlm = DLMConfig(model_running_mode="difflm-shift", mask_token_id=tokenizer.mask)
    save_checkpoint(tmp_path / "ckpt", tiny_config(vocab_size=8192, unpadded_vocab_size=8192, qk_layernorm=True),
                    dlm, tokenizer=identity)
    export(tmp_path / "ckpt", tmp_path / "hf", "--tokenizer-model", SPM)
    argv = ["--load", str(tmp_path / "ckpt"), "--hf-path", str(tmp_path / "hf"), "--seq-length", "24"]
    assert verify_correctness_dlm.main(argv) == 0
    output = capsys.readouterr().out
    assert "SentencePieceTokenizer" in output and "max abs diff" in output and "OK" in output
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"] += 1e-2
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert verify_correctness_dlm.main(argv) == 1
    assert "FAILED" in capsys.readouterr().out
