"""What --load accepts from a checkpoint's metadata, and the message when it does not."""

import dataclasses
from types import SimpleNamespace

import pytest

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpointing import FORMAT_VERSION, _check_compatible


def config(**changes) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=640,
                unpadded_vocab_size=513)
    return TransformerConfig(**(base | changes))


def check(saved: TransformerConfig, run: TransformerConfig, finetune=False, saved_sha="a", run_sha="a"):
    metadata = {"format_version": FORMAT_VERSION, "transformer_config": dataclasses.asdict(saved),
                "tokenizer": {"sha256": saved_sha}}
    args = SimpleNamespace(transformer_config=run, finetune=finetune, tokenizer=SimpleNamespace(
        identity={"sha256": run_sha}))
    _check_compatible(args, metadata, "ckpt/iter_0000010")


def test_same_architecture_and_tokenizer_load():
    check(config(), config(vocab_size=768))  # the padding may differ (another tp)


def test_an_architecture_difference_names_the_field():
    with pytest.raises(ValueError, match="ckpt/iter_0000010: the checkpoint has hidden_size=32 but this run has 48"):
        check(config(), config(hidden_size=48))


def test_another_tokenizer_is_refused():
    with pytest.raises(ValueError, match="another tokenizer"):
        check(config(), config(), saved_sha="a", run_sha="b")


def test_extra_stored_vocabulary_rows_load_as_padding():
    # A converted Qwen: 151,936 embedding rows for a 151,665-token tokenizer.
    check(config(vocab_size=151936, unpadded_vocab_size=151936), config(vocab_size=151680, unpadded_vocab_size=151665))


def test_a_grown_vocabulary_needs_finetune():
    grown = config(unpadded_vocab_size=520)
    with pytest.raises(ValueError, match="513 vocabulary rows but this run's tokenizer has 520 tokens; pass --finetune"):
        check(config(), grown)
    check(config(), grown, finetune=True)
