"""tools/preprocess_data.py: round trip, partitions, malformed lines, light imports."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preprocess_data  # noqa: E402

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def write_jsonl(path, documents, gz=False, extra_lines=()):
    lines = [json.dumps({"text": " ".join(map(str, doc)), "id": i}) for i, doc in enumerate(documents)]
    lines[2:2] = list(extra_lines)
    data = "\n".join(lines) + "\n"
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(data)
    else:
        Path(path).write_text(data)


def documents(count=50, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 998, size=rng.integers(1, 40)).tolist() for _ in range(count)]


@pytest.mark.parametrize("gz", [False, True])
def test_documents_read_back_identical(tmp_path, gz):
    docs = documents()
    source = tmp_path / ("in.jsonl.gz" if gz else "in.jsonl")
    write_jsonl(source, docs, gz)
    counts = preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                                   "--append-eod", "--workers", "1", *NULL])
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert counts["documents"] == len(docs) == len(dataset)
    assert dataset.dtype == np.uint16
    for i, doc in enumerate(docs):
        assert dataset[i].tolist() == doc + [999], "EOD (id 999 of the NullTokenizer) ends each document"


def test_partitions_and_workers_give_the_same_bytes(tmp_path):
    source = tmp_path / "in.jsonl"
    write_jsonl(source, documents(120))
    outputs = []
    for name, flags in (("single", ["--workers", "1"]), ("parallel", ["--workers", "2", "--partitions", "3"])):
        preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / name), "--append-eod",
                              *flags, *NULL])
        outputs.append(tuple((tmp_path / f"{name}_text_document{ext}").read_bytes() for ext in (".bin", ".idx")))
    assert outputs[0] == outputs[1]
    assert not list(tmp_path.glob("*part*")), "partition files are removed after the merge"


def test_malformed_lines_are_reported_and_skipped_or_fatal(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    write_jsonl(source, documents(5), extra_lines=["{not json", json.dumps({"title": "no text key"})])
    counts = preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                                   "--workers", "1", *NULL])
    err = capsys.readouterr().err
    assert counts["skipped"] == 2 and counts["documents"] == 5
    assert f"{source}:3: not valid JSON" in err and f"{source}:4: no string field 'text'" in err
    assert "skipped 2 malformed lines" in err
    with pytest.raises(SystemExit, match=r"in.jsonl:3: not valid JSON.*--strict"):
        preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "strict"), "--strict",
                              "--workers", "1", *NULL])


def test_missing_tokenizer_file_is_one_clear_error(tmp_path):
    source = tmp_path / "in.jsonl"
    write_jsonl(source, documents(3))
    result = subprocess.run([sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input", str(source),
                             "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "SentencePieceTokenizer",
                             "--tokenizer-model", str(tmp_path / "missing.model")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "missing.model" in result.stderr and "Traceback" not in result.stderr


def test_preprocessing_imports_neither_torch_nor_the_training_loop():
    code = ("import sys; sys.path.insert(0, 'tools'); import preprocess_data; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or m.startswith('megatron.training.training')]; print(bad); assert not bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
