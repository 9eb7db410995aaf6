"""GPTDataset indices, caching, resumption, blending and the data flags."""

import numpy as np
import pytest

from megatron.core.datasets.blended_dataset import BlendedDataset, blend_indices
from megatron.core.datasets.data_samplers import MegatronPretrainingSampler
from megatron.core.datasets.dataset_builder import DatasetBuilder, parse_data_paths
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, split_document_ranges
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def write_unique_token_corpus(prefix, num_documents=40, seed=0):
    """Every token id is its global position, so samples can be traced back exactly."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, size=num_documents)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    start = 0
    for length in lengths:
        builder.add_document(np.arange(start, start + length))
        start += length
    builder.finalize(f"{prefix}.idx")
    return lengths


def make(prefix, seq_length=16, seed=1, samples=None, document_range=None, cache_dir=None):
    indexed = IndexedDataset(str(prefix))
    document_range = document_range or (0, len(indexed))
    tokens = int(indexed.sequence_lengths[document_range[0]:document_range[1]].sum())
    samples = samples if samples is not None else (tokens - 1) // seq_length
    return GPTDataset(indexed, str(prefix), document_range, samples,
                      GPTDatasetConfig(seq_length, seed, str(cache_dir) if cache_dir else None))


@pytest.fixture
def corpus(tmp_path):
    prefix = tmp_path / "corpus"
    lengths = write_unique_token_corpus(prefix)
    return prefix, lengths


@pytest.mark.parametrize("epochs", [1, 2, 3])
def test_every_token_appears_once_per_epoch(corpus, epochs):
    prefix, lengths = corpus
    seq = 16
    total = int(lengths.sum())
    dataset = make(prefix, seq, samples=epochs * ((total - 1) // seq))
    seen = np.concatenate([dataset.sample_tokens(i)[:seq] for i in range(len(dataset))])
    counts = np.bincount(seen, minlength=total)
    # Samples tile the shuffled epochs back to back; only the tail of the last epoch is unused.
    assert counts.max() <= epochs
    assert (counts >= epochs - 1).all()
    unused = epochs * total - len(seen)
    assert (counts == epochs - 1).sum() == unused < seq + max(lengths) + 1


def test_samples_overlap_by_the_extra_token(corpus):
    prefix, _ = corpus
    dataset = make(prefix, 16)
    order = np.argsort(np.asarray(dataset.shuffle_index))  # position of sample j in the served order
    for j in range(len(dataset) - 1):
        this, following = dataset.sample_tokens(order[j]), dataset.sample_tokens(order[j + 1])
        assert len(this) == 17 and this[16] == following[0]


def test_same_seed_same_samples_other_seed_other_order(corpus, tmp_path):
    prefix, _ = corpus
    a, b = make(prefix, seed=5, cache_dir=tmp_path / "c1"), make(prefix, seed=5, cache_dir=tmp_path / "c2")
    c = make(prefix, seed=6, cache_dir=tmp_path / "c3")
    assert all(np.array_equal(a.sample_tokens(i), b.sample_tokens(i)) for i in range(len(a)))
    assert any(not np.array_equal(a.sample_tokens(i), c.sample_tokens(i)) for i in range(len(a)))


def test_index_cache_is_reused_and_keyed_by_what_determines_it(corpus, tmp_path):
    prefix, _ = corpus
    cache = tmp_path / "cache"
    assert make(prefix, 16, seed=1, cache_dir=cache).built_now
    again = make(prefix, 16, seed=1, cache_dir=cache)
    assert not again.built_now, "the second build must load the cached indices"
    assert make(prefix, 8, seed=1, cache_dir=cache).built_now, "a new sequence length rebuilds"
    assert make(prefix, 16, seed=2, cache_dir=cache).built_now, "a new seed rebuilds"
    assert len(list(cache.glob("*.npy"))) == 9


def test_resuming_at_consumed_samples_continues_the_stream(corpus):
    prefix, _ = corpus
    dataset = make(prefix, 8)
    full = [index for batch in MegatronPretrainingSampler(len(dataset), 0, 2, 0, 1) for index in batch]
    resumed = [index for batch in MegatronPretrainingSampler(len(dataset), 10, 2, 0, 1) for index in batch]
    assert resumed == full[10:]
    rank_batches = [list(MegatronPretrainingSampler(len(dataset), 10, 2, rank, 2)) for rank in (0, 1)]
    interleaved = [i for pair in zip(*rank_batches) for batch in pair for i in batch]
    assert interleaved == full[10:10 + len(interleaved)]


def test_blend_tracks_the_weights():
    dataset_index, sample_index = blend_indices([0.7, 0.3], 10_000)
    counts = np.bincount(dataset_index)
    assert abs(counts[0] / 10_000 - 0.7) < 0.01 and abs(counts[1] / 10_000 - 0.3) < 0.01
    for prefix_end in (10, 100, 1000):  # deficit rule: every prefix is within one sample
        assert abs(np.sum(dataset_index[:prefix_end] == 0) - 0.7 * prefix_end) <= 1
    for d in (0, 1):  # each component is read in order without gaps
        assert np.array_equal(sample_index[dataset_index == d], np.arange(counts[d]))


def test_blended_dataset_serves_stream_indices(corpus, tmp_path):
    prefix, _ = corpus
    first, second = make(prefix, 8, seed=1, samples=50), make(prefix, 8, seed=2, samples=50)
    blended = BlendedDataset([first, second], [0.7, 0.3], 40, cache_dir=str(tmp_path / "blend"))
    item = blended[7]
    source = [first, second][int(blended.dataset_index[7])]
    assert int(item["index"]) == 7
    assert np.array_equal(item["tokens"].numpy(), source.sample_tokens(int(blended.dataset_sample_index[7])))


def test_split_ranges():
    assert split_document_ranges(1000, "949,50,1") == ((0, 949), (949, 999), (999, 1000))
    assert split_document_ranges(10, "1,0,0") == ((0, 10), (10, 10), (10, 10))
    with pytest.raises(ValueError, match="--split"):
        split_document_ranges(10, "a,b")


def test_builder_splits_and_blends_two_corpora(tmp_path):
    write_unique_token_corpus(tmp_path / "a", seed=1)
    write_unique_token_corpus(tmp_path / "b", seed=2)
    builder = DatasetBuilder(GPTDatasetConfig(8, 1, str(tmp_path / "cache")))
    train, valid, test = builder.from_split(["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")],
                                            "8,1,1", [60, 10, 0])
    assert isinstance(train, BlendedDataset) and len(train) == 60 and len(valid) == 10 and test is None
    assert parse_data_paths(["2", "x", "6", "y"]) == (["x", "y"], [0.25, 0.75])
    with pytest.raises(ValueError, match="pairs"):
        parse_data_paths(["0.5", "x", "0.5"])
