"""Sharded save/load in one process: round trip, and clear errors for a different model."""

import errno
import re
import threading

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core.dist_checkpointing import serialization
from megatron.core.errors import InputError
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


def test_a_damaged_shard_is_named(tmp_path):
    serialization.save(model().sharded_state_dict(), str(tmp_path / "ckpt"))
    shard = sorted((tmp_path / "ckpt").glob("*.distcp"))[-1]
    whole = shard.read_bytes()
    shard.write_bytes(b"\0" * len(whole))  # the right size: found only by reading it
    with pytest.raises(InputError, match=re.escape(f"{shard} cannot be read") + ".*the checkpoint is damaged"):
        serialization.load(model(seed=1).sharded_state_dict(), str(tmp_path / "ckpt"))
    shard.write_bytes(whole[: len(whole) // 2])  # cut short: found from the sizes, before reading
    with pytest.raises(InputError, match=re.escape(f"{shard} is {len(whole) // 2} bytes where the index expects")):
        serialization.load(model(seed=1).sharded_state_dict(), str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / ".metadata").unlink()
    with pytest.raises(ValueError, match="no readable .metadata"):
        serialization.load(model(seed=1).sharded_state_dict(), str(tmp_path / "ckpt"))


def test_a_file_failing_in_a_writer_thread_fails_the_save(tmp_path, monkeypatch, capfd):
    """A full disk met by one of DCP's helper threads: without the check, that thread dies with a
    printed traceback and the save completes without its file (an index naming a missing tensor)."""
    write_item, helper_failed = dcp_filesystem._write_item, threading.Event()

    def disk_full_for_helpers(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            helper_failed.wait(timeout=60)  # the other files are left to the helper threads
            return write_item(*args, **kwargs)
        helper_failed.set()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_filesystem, "_write_item", disk_full_for_helpers)
    with pytest.raises((OSError, CheckpointException)) as raised:
        serialization.save(model().sharded_state_dict(), str(tmp_path / "ckpt"))
    assert helper_failed.is_set() and "No space left on device" in str(raised.value)
    assert not (tmp_path / "ckpt" / ".metadata").exists(), "no index for a checkpoint missing files"
    assert "Exception in thread" not in capfd.readouterr().err



def test_a_full_disk_while_the_index_is_written_fails_the_save(tmp_path, monkeypatch):
    """The index (.metadata) is the last file a save writes: an error there must fail the save too,
    not leave a cut-short index renamed into place as if the save had finished."""
    dump = dcp_filesystem.pickle.dump

    def disk_full(obj, stream, *args, **kwargs):
        stream.write(b"\x80")  # a few bytes reach the file before the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_filesystem.pickle, "dump", disk_full)
    with pytest.raises((OSError, CheckpointException)) as raised:
        serialization.save(model().sharded_state_dict(), str(tmp_path / "ckpt"))
    monkeypatch.setattr(dcp_filesystem.pickle, "dump", dump)
    assert "No space left on device" in str(raised.value)
    assert not (tmp_path / "ckpt" / ".metadata").exists(), "a cut-short index renamed into place"

@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (2, 4, 3, 2)])
def test_linear_ranges_become_disjoint_boxes_covering_exactly_those_elements(shape):
    from megatron.core.dist_checkpointing.model_state import linear_range_boxes

    total = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    for start in range(total.numel()):
        for stop in range(start, total.numel() + 1):
            covered = []
            for offset, size in linear_range_boxes(shape, start, stop):
                box = total[tuple(slice(o, o + n) for o, n in zip(offset, size))]
                covered.extend(box.reshape(-1).tolist())
            assert covered == list(range(start, stop)), (shape, start, stop)


def test_optimizer_state_is_described_with_the_parameters_boxes():
    from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict, optimizer_sharded_state_dict

    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randint(0, 63, (2, 8))).sum().backward()
    optimizer.step()
    weights = model_sharded_state_dict(net)
    state = optimizer_sharded_state_dict(net, optimizer)
    assert len(state) == 2 * len([p for p in weights.values() if p.key.startswith("model.")]) > 0
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    weight = next(p for p in weights.values() if p.key == f"model.{qkv}")
    exp_avg = next(p for p in state.values() if p.key == f"optimizer.exp_avg.{qkv}")
    assert exp_avg.global_shape == weight.global_shape == (2, 4, 8, 32)
    param = net.decoder.layers["0"].self_attention.linear_qkv.weight
    assert torch.equal(exp_avg.data.reshape(param.shape), optimizer.state[param]["exp_avg"])
    assert exp_avg.data.data_ptr() == optimizer.state[param]["exp_avg"].data_ptr(), "a view, filled in place on load"
