"""Learned absolute positions (--position-embedding-type learned_absolute, Megatron-LM's GPT default): the
embedding adds the table's rows of each token's position before the dropout, drawn privately at build time;
the sampler's positions (from each row's first real token) make a left-padded row sample as it does alone;
a checkpoint carries the type and the table's rows (--use-checkpoint-args), and another row count is refused.
Every layout: tests/distributed/test_layout_matrix.py, test_pipeline_parallel.py, test_context_parallel.py
(the `gpt3` configuration)."""

import dataclasses

import pytest
import torch

from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from tests.unit_tests.test_checkpoint_compatibility import check, config


def model(mode="vanilla", **changes) -> GPTModel:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                max_position_embeddings=24, position_embedding_type="learned_absolute", init_method_std=0.5)
    torch.manual_seed(0)
    return GPTModel(TransformerConfig(**(base | changes)), DLMConfig(model_running_mode=mode, mask_token_id=63)).eval()


def test_the_embedding_adds_each_positions_row_and_the_model_has_no_rotary_tables():
    net = model()
    ids, positions = torch.tensor([[5, 9, 11], [7, 7, 2]]), torch.tensor([[0, 1, 2], [4, 5, 6]])
    word, table = net.embedding.word_embeddings.weight, net.embedding.position_embeddings.weight
    expected = (word[ids] + table[positions]).transpose(0, 1)
    torch.testing.assert_close(net.embedding(ids, position_ids=positions), expected)
    assert net.rotary_pos_emb is None and table.shape == (24, 32)
    with torch.no_grad():
        assert not torch.allclose(net(ids), net(ids, position_ids=positions))  # positions reach the output


def test_the_table_is_drawn_without_touching_the_global_generator():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    rope, learned = (GPTModel(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                                                vocab_size=64, position_embedding_type=kind),
                              DLMConfig(model_running_mode="vanilla")) for kind in ("rope", "learned_absolute"))
    assert torch.equal(torch.get_rng_state(), before)
    torch.testing.assert_close(rope.embedding.word_embeddings.weight, learned.embedding.word_embeddings.weight)


@pytest.mark.parametrize("mode", ["vanilla", "difflm-noshift"])
def test_a_left_padded_row_samples_as_it_does_alone(mode):
    net = model(mode)
    rows = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12, 13])]
    ids = torch.zeros(2, 6, dtype=torch.long)
    real = torch.zeros(2, 6, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, 6 - len(row):], real[index, 6 - len(row):] = row, 1
    options = dict(gen_length=8) if mode == "vanilla" else dict(gen_length=8, steps=8, block_length=4)
    batched = net.generate(ids, real, **options)
    for index, row in enumerate(rows):
        alone = net.generate(row[None], **options)
        assert torch.equal(batched[index, 6 - len(row):], alone[0]), index


def test_a_checkpoint_carries_the_type_and_the_tables_rows():
    learned = config(position_embedding_type="learned_absolute", max_position_embeddings=32)
    check(learned, learned)
    with pytest.raises(ValueError, match=r"position_embedding_type='learned_absolute' but this run has 'rope'"):
        check(learned, config(max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"max_position_embeddings=32 but this run has 48 \(--max-position-embeddings"):
        check(learned, dataclasses.replace(learned, max_position_embeddings=48), finetune=True)
    check(config(max_position_embeddings=32), config(max_position_embeddings=48))  # RoPE: no table, no shape
