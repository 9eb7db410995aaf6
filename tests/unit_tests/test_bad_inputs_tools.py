"""Bad inputs to the conversion, generation and evaluation tools.

Each case asserts what a user sees: a non-zero exit, one line `error: ...` on stderr naming the
flag or the file, no traceback; and where data existed before (an earlier export, a checkpoint,
a report), that it is byte for byte unchanged and still loads. A few cases run the real CLI in a
subprocess, the rest call the tool's `main(argv)` in this process. One tiny NullTokenizer DLM
checkpoint (1 layer, hidden 32, 64 positions) and its export serve every case.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")  # the checkpoint helpers of the conversion tests
from megatron.core.transformer.transformer_config import DLMConfig  # noqa: E402
from tests.unit_tests.test_hf_conversion import VOCAB, save_checkpoint, tiny_config  # noqa: E402
from tools.weights_conversion import checkpoint_io, hf_to_megatron, megatron_to_hf  # noqa: E402
from tools.weights_conversion import verify_correctness_dlm  # noqa: E402
from tools.weights_conversion.safetensors_io import LazyWeights  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import evaluate_multiple_choice  # noqa: E402

_spec = importlib.util.spec_from_file_location("dlm_inference", ROOT / "examples" / "dlm_generation" /
                                               "dlm_inference.py")
dlm_inference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dlm_inference)

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A checkpoint (iteration 3) and its Hugging Face export; tests copy them before changing anything."""
    root = tmp_path_factory.mktemp("bad_inputs")
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=VOCAB - 1)
    save_checkpoint(root / "ckpt", tiny_config(num_layers=1), dlm)
    assert megatron_to_hf.main(["--load", str(root / "ckpt"), "--save", str(root / "export"), "--dtype", "float32",
                                "--no-progress"]) == 0
    return SimpleNamespace(ckpt=root / "ckpt", export=root / "export")


# ------------------------------------------------------------------------------ helpers
def snapshot(folder: Path) -> dict:
    """Every file's bytes and mtime, and every folder, under `folder` (the folder itself included)."""
    entries = {".": folder.stat().st_mtime_ns}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        entries[key] = (path.read_bytes(), path.stat().st_mtime_ns) if path.is_file() else None
    return entries


def copy(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination, copy_function=shutil.copy2)
    return destination


def call(main, argv, capsys):
    """(exit status, stdout, stderr) of a tool's main run in this process."""
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli(script: str, *argv):
    """(exit status, stdout, stderr) of the real command line."""
    result = subprocess.run([sys.executable, str(ROOT / script), *map(str, argv)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return result.returncode, result.stdout, result.stderr


def assert_one_clear_error(code, err: str, *names: str) -> str:
    """Non-zero exit, no traceback, one `error:` line naming each of `names`; returns that line."""
    assert isinstance(code, int) and code != 0, code
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def assert_export_loads(folder: Path) -> None:
    weights = LazyWeights(str(folder))
    tensors = {name: weights.get(name) for name in weights.names()}
    assert "model.embed_tokens.weight" in tensors and len(tensors) > 3
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DLMForCausalLM"]


def siblings(folder: Path) -> list:
    """Temporary folders an export left beside its --save."""
    return sorted(path.name for path in folder.parent.iterdir() if path.name.startswith(folder.name + "."))


def truncate(path: Path, size: int = 100) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def tracker_to_missing_iteration(tiny, tmp_path) -> Path:
    ckpt = copy(tiny.ckpt, tmp_path / "ckpt")
    (ckpt / TRACKER).write_text("7")
    return ckpt


# ------------------------------------------------------------------------------ export safety
def test_export_from_a_damaged_checkpoint_keeps_the_earlier_export(tiny, tmp_path):
    damaged = copy(tiny.ckpt, tmp_path / "damaged")
    shard = sorted((damaged / "iter_0000003").glob("*.distcp"))[1]
    truncate(shard)
    save = copy(tiny.export, tmp_path / "hf")
    (save / "README.md").write_text("my notes")
    before = snapshot(save)
    code, _, err = cli("tools/weights_conversion/megatron_to_hf.py", "--load", damaged, "--save", save,
                       "--no-progress")
    assert_one_clear_error(code, err, shard.name, "damaged")
    assert snapshot(save) == before and siblings(save) == []
    assert_export_loads(save)


@pytest.mark.parametrize("failure", ["damage inside a shard", "disk full after the weights"])
def test_export_failing_mid_way_keeps_the_earlier_export(failure, tiny, tmp_path, capsys, monkeypatch):
    ckpt = copy(tiny.ckpt, tmp_path / "ckpt")
    if failure == "damage inside a shard":  # same size, so only reading it finds the damage
        for shard in (ckpt / "iter_0000003").glob("*.distcp"):
            shard.write_bytes(b"\0" * shard.stat().st_size)
    else:
        def full_disk(output_dir):
            raise OSError(28, "No space left on device", output_dir)
        monkeypatch.setattr(megatron_to_hf, "_write_remote_code", full_disk)
    save = copy(tiny.export, tmp_path / "hf")
    before = snapshot(save)
    code, _, err = call(megatron_to_hf.main, ["--load", ckpt, "--save", save, "--no-progress"], capsys)
    assert_one_clear_error(code, err, "iter_0000003" if failure.startswith("damage") else "No space left")
    assert snapshot(save) == before and siblings(save) == []
    assert_export_loads(save)


def test_an_export_replaces_an_earlier_one_whole(tiny, tmp_path, capsys):
    save = copy(tiny.export, tmp_path / "hf")
    (save / "README.md").write_text("my notes")
    code, _, _ = call(megatron_to_hf.main, ["--load", tiny.ckpt, "--save", save, "--no-progress",
                                            "--max-shard-size", "20KB"], capsys)
    assert code == 0 and siblings(save) == []
    names = set(os.listdir(save))
    assert "model.safetensors" not in names, "a stale shard of the earlier export"
    assert "model.safetensors.index.json" in names and (save / "README.md").read_text() == "my notes"
    assert_export_loads(save)


def test_export_refuses_a_save_folder_that_is_not_an_export(tiny, tmp_path, capsys):
    save = tmp_path / "models"
    (save / "other_model").mkdir(parents=True)
    (save / "notes.txt").write_text("keep")
    before = snapshot(save)
    code, _, err = call(megatron_to_hf.main, ["--load", tiny.ckpt, "--save", save, "--no-progress"], capsys)
    assert_one_clear_error(code, err, f"--save {save}", "other_model")
    assert snapshot(save) == before and siblings(save) == []


# ------------------------------------------------------------------------------ bad checkpoints
@pytest.mark.parametrize("tool", ["megatron_to_hf", "dlm_inference", "evaluate"])
def test_a_tracker_naming_a_missing_iteration(tool, tiny, tmp_path, capsys):
    ckpt = tracker_to_missing_iteration(tiny, tmp_path)
    before = snapshot(ckpt)
    main, argv = {"megatron_to_hf": (megatron_to_hf.main, ["--save", tmp_path / "hf"]),
                  "dlm_inference": (dlm_inference.main, ["--prompt", "1 2 3", "--device", "cpu"]),
                  "evaluate": (evaluate_multiple_choice.main, ["--device", "cpu"])}[tool]
    code, _, err = call(main, ["--load", ckpt, *argv], capsys)
    assert_one_clear_error(code, err, str(ckpt / TRACKER), "iteration 7", "iter_0000007")
    assert snapshot(ckpt) == before and not (tmp_path / "hf").exists()
    checkpoint_io.load_model(str(ckpt), iteration=3)  # the complete iteration still loads


@pytest.mark.parametrize("tool", ["megatron_to_hf", "verify_correctness_dlm"])
def test_metadata_json_missing(tool, tiny, tmp_path, capsys):
    ckpt = copy(tiny.ckpt, tmp_path / "ckpt")
    (ckpt / "iter_0000003" / "metadata.json").unlink()
    main, argv = {"megatron_to_hf": (megatron_to_hf.main, ["--save", tmp_path / "hf", "--no-progress"]),
                  "verify_correctness_dlm": (verify_correctness_dlm.main, ["--hf-path", tiny.export])}[tool]
    code, _, err = call(main, ["--load", ckpt, *argv], capsys)
    assert_one_clear_error(code, err, str(ckpt / "iter_0000003" / "metadata.json"), "missing")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("tool", ["dlm_inference", "evaluate"])
def test_a_truncated_checkpoint_shard_is_named_before_loading(tool, tiny, tmp_path, capsys):
    ckpt = copy(tiny.ckpt, tmp_path / "ckpt")
    shard = sorted((ckpt / "iter_0000003").glob("*.distcp"))[0]
    truncate(shard)
    main = dlm_inference.main if tool == "dlm_inference" else evaluate_multiple_choice.main
    code, _, err = call(main, ["--load", ckpt, "--device", "cpu"], capsys)
    assert_one_clear_error(code, err, str(shard), "damaged")


@pytest.mark.parametrize("tool", ["megatron_to_hf", "verify_correctness_dlm", "dlm_inference", "evaluate"])
def test_a_missing_load(tool, tiny, tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    main, argv = {"megatron_to_hf": (megatron_to_hf.main, ["--save", tmp_path / "hf"]),
                  "verify_correctness_dlm": (verify_correctness_dlm.main, ["--hf-path", tiny.export]),
                  "dlm_inference": (dlm_inference.main, ["--device", "cpu"]),
                  "evaluate": (evaluate_multiple_choice.main, ["--device", "cpu"])}[tool]
    code, _, err = call(main, ["--load", missing, *argv], capsys)
    assert_one_clear_error(code, err, f"--load {missing}", "does not exist")
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------ bad HF folders
def test_a_truncated_model_safetensors_into_hf_to_megatron(tiny, tmp_path):
    hf = copy(tiny.export, tmp_path / "hf")
    truncate(hf / "model.safetensors", 1000)
    code, _, err = cli("tools/weights_conversion/hf_to_megatron.py", "--hf-path", hf, "--save", tmp_path / "ckpt",
                       "--no-progress")
    assert_one_clear_error(code, err, str(hf / "model.safetensors"), "fetch or export the folder again")
    assert not (tmp_path / "ckpt").exists()


def test_a_truncated_export_into_verify_correctness(tiny, tmp_path, capsys):
    hf = copy(tiny.export, tmp_path / "hf")
    truncate(hf / "model.safetensors", 1000)
    code, _, err = call(verify_correctness_dlm.main, ["--load", tiny.ckpt, "--hf-path", hf], capsys)
    assert_one_clear_error(code, err, str(hf / "model.safetensors"))


def test_hf_to_megatron_never_writes_over_a_checkpoint(tiny, tmp_path, capsys):
    ckpt = copy(tiny.ckpt, tmp_path / "ckpt")
    before = snapshot(ckpt)
    code, _, err = call(hf_to_megatron.main, ["--hf-path", tiny.export, "--save", ckpt, "--no-progress"], capsys)
    assert_one_clear_error(code, err, f"--save {ckpt}", TRACKER)
    assert snapshot(ckpt) == before
    checkpoint_io.load_model(str(ckpt))


def test_hf_to_megatron_failing_mid_write_leaves_no_tracker(tiny, tmp_path, capsys, monkeypatch):
    save_dcp = checkpoint_io.dcp.save

    def write_then_fill_the_disk(state, checkpoint_id):
        save_dcp(state, checkpoint_id=checkpoint_id)  # the shards are there, metadata.json is not
        raise OSError(28, "No space left on device", str(checkpoint_id))

    monkeypatch.setattr(checkpoint_io.dcp, "save", write_then_fill_the_disk)
    save = tmp_path / "ckpt"
    save.mkdir()
    code, _, err = call(hf_to_megatron.main, ["--hf-path", tiny.export, "--save", save, "--no-progress"], capsys)
    assert_one_clear_error(code, err, "No space left")
    assert os.listdir(save) == [], "no tracker, no iteration, no staging folder"
    monkeypatch.undo()  # the same --save then takes a complete conversion
    code, _, _ = call(hf_to_megatron.main, ["--hf-path", tiny.export, "--save", save, "--no-progress"], capsys)
    assert code == 0 and (save / TRACKER).read_text() == "0"
    checkpoint_io.load_model(str(save))


# ------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("prompt, names", [
    ("", ["--prompt is empty"]),
    ("   ", ["--prompt is empty"]),
    (" ".join(["5"] * 50), ["--prompt (50 tokens)", "--max-new-tokens 32", "64", "shorten --prompt"]),
    ("Fellow-Citizens of the Senate", ["--prompt 'Fellow-Citizens", "NullTokenizer", "token ids"]),
    (f"1 2 {VOCAB + 5}", ["--prompt", f"token id {VOCAB + 5}", f"[0, {VOCAB})"]),
])
def test_bad_prompts_are_named_before_the_model_loads(prompt, names, tiny, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the prompt was checked")

    monkeypatch.setattr(dlm_inference, "load_inference_model", no_loading)
    code, _, err = call(dlm_inference.main, ["--load", tiny.ckpt, "--prompt", prompt, "--device", "cpu"], capsys)
    line = assert_one_clear_error(code, err, *names)
    assert "--max-position-embeddings" not in line, "a training flag, not one of this tool's"


def test_max_new_tokens_not_a_multiple_of_the_block_length(tiny):
    code, out, err = cli("examples/dlm_generation/dlm_inference.py", "--load", tiny.ckpt, "--prompt", "1 2 3",
                         "--max-new-tokens", "10", "--inference-block-size", "8", "--device", "cpu")
    assert_one_clear_error(code, err, "--max-new-tokens 10", "--inference-block-size 8", "--max-new-tokens 16")
    assert "loaded" not in out, "checked before the checkpoint's weights are read"


# ------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("where", ["under a file", "in a missing folder", "a folder"])
def test_evaluate_json_unwritable_is_found_before_the_evaluation(where, tiny, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    path = {"under a file": tmp_path / "afile" / "report.json",
            "in a missing folder": tmp_path / "missing" / "report.json", "a folder": tmp_path}[where]

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --json was checked")

    monkeypatch.setattr(evaluate_multiple_choice, "load_inference_model", no_loading)
    code, _, err = call(evaluate_multiple_choice.main, ["--load", tiny.ckpt, "--device", "cpu", "--json", path],
                        capsys)
    assert_one_clear_error(code, err, f"--json {path}")
    assert sorted(os.listdir(tmp_path)) == ["afile"] and (tmp_path / "afile").read_text() == "x"


def test_evaluate_a_null_tokenizer_checkpoint_keeps_the_earlier_report(tiny, tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text('{"acc": 0.5}')
    before = (report.read_bytes(), report.stat().st_mtime_ns)
    code, _, err = call(evaluate_multiple_choice.main, ["--load", tiny.ckpt, "--device", "cpu", "--json", report],
                        capsys)
    assert_one_clear_error(code, err, f"--load {tiny.ckpt}", "NullTokenizer")
    assert (report.read_bytes(), report.stat().st_mtime_ns) == before and os.listdir(tmp_path) == ["report.json"]
