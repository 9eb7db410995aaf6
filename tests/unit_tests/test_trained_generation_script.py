"""tools/benchmark/trained_generation.sh: the runs its `train` and `measure` stages chain, read with
stand-in `torchrun` and `python` that record their arguments (the real runs need a GPU and minutes),
and that a failed run leaves the earlier model in place."""

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tools/benchmark/trained_generation.sh"


def run_stage(tmp_path: Path, stage: str, fail_on: str = "", script: str = SCRIPT, args=(), **extra_env) -> list:
    """(exit code, each recorded call of `script`'s `stage` (with `args`) as its argument list); a call whose
    arguments hold `fail_on` fails."""
    bin_dir, record = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    stand_in = ('#!/usr/bin/env bash\nprintf "%q " "$@" >> {record}; echo >> {record}\n'
                'for a in "$@"; do [[ -n "{fail}" && $a == *"{fail}"* ]] && exit 3; done\n'
                # a training run writes its --save folder, as the real one does
                'while (( $# )); do [[ $1 == --save ]] && mkdir -p "$2" && touch "$2/written"; shift; done\n'
                ).format(record=shlex.quote(str(record)), fail=fail_on)
    for name in ("torchrun", "fakepython"):
        (bin_dir / name).write_text(stand_in)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", WORK=str(tmp_path / "work"), PYTHON="fakepython",
               **extra_env)
    result = subprocess.run(["bash", script, stage, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    calls = [shlex.split(line) for line in record.read_text().splitlines()] if record.exists() else []
    return result.returncode, calls


def _flag(call: list, name: str) -> str:
    return call[call.index(name) + 1]


def test_train_fine_tunes_ar_then_the_dlm_twice_and_measure_judges_by_the_ar_model(tmp_path):
    code, calls = run_stage(tmp_path, "train")
    work = str(tmp_path / "work")
    assert code == 0 and [c[2] for c in calls] == ["pretrain_difflm.py"] * 3
    chain = [(_flag(c, "--load"), _flag(c, "--save"), _flag(c, "--model-running-mode"), _flag(c, "--train-iters"))
             for c in calls]
    assert chain == [(f"{work}/init_ar", f"{work}/ar.new", "vanilla", "600"),
                     (f"{work}/init_dlm", f"{work}/dlm_first.new", "difflm-shift", "600"),
                     (f"{work}/dlm_first", f"{work}/dlm.new", "difflm-shift", "1200")]
    assert all(os.path.exists(f"{work}/{name}/written") for name in ("ar", "dlm_first", "dlm"))
    assert _flag(calls[1], "--mask-token") == "16" and "--finetune" in calls[0]
    code, calls = run_stage(tmp_path, "measure")
    assert code == 0 and [_flag(c, "--load") for c in calls[-2:]] == [f"{work}/dlm", f"{work}/ar"]
    assert all(_flag(c, "--judge") == f"{work}/ar" for c in calls[-2:])


def test_a_failed_training_run_keeps_the_earlier_model(tmp_path):
    assert run_stage(tmp_path, "train")[0] == 0
    (tmp_path / "work" / "ar" / "earlier").touch()
    code, _ = run_stage(tmp_path, "train", fail_on="ar.new")
    assert code != 0 and (tmp_path / "work" / "ar" / "earlier").exists()


def test_sft_tokenizes_the_task_then_fine_tunes_both_and_measure_chat_stops_at_eos(tmp_path):
    code, calls = run_stage(tmp_path, "sft")
    work = str(tmp_path / "work")
    assert code == 0 and [c[0] for c in calls[:2]] == ["tools/preprocess_data.py"] * 2
    assert all("--chat" in c for c in calls[:2])
    assert [_flag(c, "--input") for c in calls[:2]] == [f"{work}/verses_{s}.jsonl.gz" for s in ("train", "valid")]
    runs = calls[2:]
    assert [(_flag(c, "--load"), _flag(c, "--save"), _flag(c, "--model-running-mode")) for c in runs] == [
        (f"{work}/ar", f"{work}/ar_sft.new", "vanilla"), (f"{work}/dlm", f"{work}/dlm_sft.new", "difflm-shift")]
    for run in runs:
        assert "--sft" in run and _flag(run, "--sft-padding") == "eos" and _flag(run, "--seq-length") == "384"
        assert _flag(run, "--train-data-path") == f"{work}/data/verses_train_text_document"
        assert _flag(run, "--train-iters") == "1000"
    assert _flag(runs[1], "--sft-normalizer") == "llada" and "--sft-normalizer" not in runs[0]
    assert all(os.path.exists(f"{work}/{name}/written") for name in ("ar_sft", "dlm_sft"))
    code, calls = run_stage(tmp_path, "measure_chat")
    measured, full = calls[-3:-1], calls[-1]
    assert "--no-eos-stop" in full and _flag(full, "--load") == f"{work}/dlm_sft"
    assert _flag(full, "--json").endswith("/dlm_chat_full.json") and "--no-eos-stop" not in measured[0]
    assert code == 0 and [_flag(c, "--load") for c in measured] == [f"{work}/dlm_sft", f"{work}/ar_sft"]
    for call in measured:
        assert _flag(call, "--prompt") == "chat" and _flag(call, "--judge") == f"{work}/ar_sft"
        assert _flag(call, "--prompt-file") == f"{work}/verses_valid.jsonl.gz"
    assert [_flag(c, "--json").rsplit("/", 1)[1] for c in measured] == ["dlm_chat.json", "ar_chat.json"]


def test_no_extra_dlm_iterations_makes_the_first_fine_tuning_the_dlm(tmp_path):
    code, calls = run_stage(tmp_path, "train", DLM_EXTRA_ITERS="0")
    work = tmp_path / "work"
    assert code == 0 and [_flag(c, "--save") for c in calls] == [f"{work}/ar.new", f"{work}/dlm_first.new"]
    assert (work / "dlm" / "written").exists() and not (work / "dlm.new").exists()
