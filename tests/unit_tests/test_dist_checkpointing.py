"""Sharded save/load in one process: round trip, and clear errors for a different model."""

import pytest
import torch

from megatron.core.dist_checkpointing import serialization
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.initialize import initialize_distributed


def model(hidden=32, seed=0):
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, vocab_size=64, qk_layernorm=True)
    return GPTModel(config, DLMConfig(mask_token_id=63))


@pytest.fixture(scope="module", autouse=True)
def process_group():
    initialize_distributed("gloo")


def test_round_trip_restores_every_weight(tmp_path):
    source, target = model(seed=0), model(seed=1)
    assert not torch.equal(source.embedding.word_embeddings.weight, target.embedding.word_embeddings.weight)
    serialization.save(source.sharded_state_dict(), str(tmp_path / "ckpt"))
    serialization.load(target.sharded_state_dict(), str(tmp_path / "ckpt"))
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_different_architecture_is_named(tmp_path):
    serialization.save(model().sharded_state_dict(), str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight.*architecture differs"):
        serialization.load(model(hidden=48).sharded_state_dict(), str(tmp_path / "ckpt"))
    renamed = {f"other.{k}": v for k, v in model().sharded_state_dict().items()}
    for piece in renamed.values():
        piece.key = "other." + piece.key
    with pytest.raises(ValueError, match="has no tensor 'other."):
        serialization.load(renamed, str(tmp_path / "ckpt"))


def test_a_damaged_shard_is_reported_with_the_checkpoint(tmp_path):
    serialization.save(model().sharded_state_dict(), str(tmp_path / "ckpt"))
    shard = next((tmp_path / "ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match="could not be read.*damaged"):
        serialization.load(model(seed=1).sharded_state_dict(), str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / ".metadata").unlink()
    with pytest.raises(ValueError, match="no readable .metadata"):
        serialization.load(model(seed=1).sharded_state_dict(), str(tmp_path / "ckpt"))
