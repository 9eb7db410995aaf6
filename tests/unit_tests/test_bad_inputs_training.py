"""pretrain_difflm.py reports every bad input as one `error:` line, without a traceback.

Flag problems exit with argparse's code 2 before anything is built; problems found only while
building (the data's document counts) raise InputError, which pretrain() turns into code 1.
A few cases run the real command line; the rest call the parser (or main) in this process.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training.arguments import parse_args

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
         "--train-iters", "1", "--eval-iters", "0", "--attention-backend", "math",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--add-mask-token"]
TINY = MODEL + ["--mock-data"] + NULL_TOKENIZER


def write_corpus(prefix: Path, num_documents: int, length: int) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for document in range(num_documents):
        builder.add_document(np.arange(length) % 60 + document % 2)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def error_line(stderr: str) -> str:
    """The one `error:` line, after checking there is exactly one and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, stderr
    return lines[0]


def parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, add_difflm_args, world_size=1)
    assert exit_info.value.code == 2
    return error_line(capsys.readouterr().err)


def run_cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "pretrain_difflm.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


# (extra flags on top of TINY, what the error line must name)
BAD_FLAGS = [
    (["--difflm-per-document-t"], "--difflm-per-document-t has no effect without --reset-attention-mask"),
    (["--sliding-window", "4"], "--sliding-window has no effect without --attention-mask-type sliding_window"),
    (["--difflm-block-size", "4"], "--difflm-block-size has no effect without --attention-mask-type block_causal"),
    (["--mask-token", "63"], "--mask-token 63 is the EOD token"),
    (["--null-tokenizer-eod-id", "64"], "--null-tokenizer-eod-id 64 is outside the vocabulary of --vocab-size 64"),
    (["--null-tokenizer-eod-id", "5", "--mask-token", "5"], "--mask-token 5 is the EOD token"),
    (["--hidden-size", "15"], "--hidden-size 15 is not divisible by --num-attention-heads 2"),
    (["--lr", "-0.001"], "--lr -0.001 must be a finite number >= 0"),
    (["--lr", "nan"], "--lr nan must be a finite number"),
    (["--lr", "inf"], "--lr inf must be a finite number"),
    (["--min-lr", "nan"], "--min-lr nan"),
    (["--clip-grad", "-1"], "--clip-grad -1.0"),
    (["--weight-decay", "inf"], "--weight-decay inf"),
    (["--adam-beta2", "1"], "--adam-beta2 1.0 must be a finite number in [0, 1)"),
    (["--attention-dropout", "1"], "attention_dropout=1.0 must be in [0, 1) (flag --attention-dropout)"),
    (["--hidden-dropout", "nan"], "(flag --hidden-dropout)"),
    (["--init-method-std", "0"], "init_method_std=0.0 must be a finite number > 0 (flag --init-method-std)"),
    (["--norm-epsilon", "nan"], "(flag --norm-epsilon)"),
    (["--rotary-percent", "0"], "(flag --rotary-percent)"),
    (["--difflm-varilen-prob", "1.5"], "(flag --difflm-varilen-prob)"),
    (["--num-layers", "0"], "--num-layers 0 must be >= 1"),
    (["--hidden-size", "-16"], "--hidden-size -16 must be >= 1"),
    (["--num-attention-heads", "0"], "--num-attention-heads 0 must be >= 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0 must be >= 1"),
    (["--vocab-size", "0"], "--vocab-size 0 must be >= 1"),
    (["--keep-last-checkpoints", "0"], "--keep-last-checkpoints 0 must be >= 1"),
    (["--keep-last-checkpoints", "-2"], "--keep-last-checkpoints -2 must be >= 1"),
    (["--difflm-varilen-multiple", "4"], "--difflm-varilen-multiple has no effect without --difflm-varilen-prob > 0"),
    (["--difflm-loss-chunk-size", "16"], "--difflm-loss-chunk-size has no effect without --difflm-masked-only-loss"),
    (["--difflm-masked-only-loss", "--difflm-loss-kernel", "inductor"],
     "--difflm-loss-kernel has no effect without --difflm-compile-loss"),
    (["--num-query-groups", "2"], "--num-query-groups has no effect without --group-query-attention"),
    (["--recompute-method", "block"], "--recompute-method has no effect without --recompute-granularity full"),
    (["--tokenizer-model", "spm.model"], "--tokenizer-model is not read by --tokenizer-type NullTokenizer"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "router_topk=5 exceeds num_experts=4 (flag --moe-router-topk)"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"],
     "needs router_score_function='sigmoid' (--moe-router-score-function sigmoid)"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*3"],
     "each of the 1 layers (e.g. [0]*1+[1]*27) (flag --moe-layer-freq)"),
    (["--num-experts", "4", "--moe-router-type", "expert_choice", "--model-running-mode", "vanilla"],
     "--moe-router-type expert_choice picks tokens over the whole sequence"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "-1"], "(flag --moe-aux-loss-coeff)"),
    (["--num-experts", "4", "--moe-grouped-gemm", "--moe-ffn-hidden-size", "12"],
     "--moe-grouped-gemm needs the expert FFN size per expert-tensor-parallel rank"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], "(flag --moe-expert-capacity-factor)"),
]


@pytest.mark.parametrize("extra,message", BAD_FLAGS, ids=[" ".join(extra) for extra, _ in BAD_FLAGS])
def test_bad_flag_exits_2_with_one_line_naming_it(extra, message, capsys):
    assert message in parse_error(TINY + extra, capsys)


def test_the_tiny_configuration_itself_parses():
    args = parse_args(TINY, add_difflm_args, world_size=1)
    assert args.dlm_config.mask_token_id == 64 and args.tokenizer.eod == 63


def test_dlm_flags_in_vanilla_mode_warn_once_and_still_parse(capsys):
    """Failing would break one launch script serving both modes (quickstart.sh with MODE=vanilla)."""
    args = parse_args(TINY + ["--model-running-mode", "vanilla", "--difflm-t-sampling", "antithetic",
                              "--difflm-per-document-t", "--difflm-eps", "0.1"], add_difflm_args, world_size=1)
    assert not args.dlm_config.is_diffusion
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    for flag in ("--difflm-t-sampling antithetic", "--difflm-per-document-t", "--difflm-eps 0.1", "vanilla"):
        assert flag in warnings[0]


def test_a_default_typed_out_is_not_an_ignored_flag(capsys):
    parse_args(TINY + ["--model-running-mode", "vanilla", "--difflm-t-sampling", "uniform", "--split", "969,30,1"],
               add_difflm_args, world_size=1)
    assert "warning:" not in capsys.readouterr().err


def test_tokenizer_type_without_its_model_file(capsys):
    line = parse_error(MODEL + ["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer"], capsys)
    assert "--tokenizer-model is required" in line


def test_missing_tokenizer_model_file(tmp_path, capsys):
    missing = tmp_path / "nowhere.model"
    line = parse_error(MODEL + ["--mock-data", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                str(missing), "--add-mask-token"], capsys)
    assert f"--tokenizer-model {missing}: no such file" in line


def test_unwritable_save_directory_fails_at_parse_time(tmp_path, capsys):
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    line = parse_error(TINY + ["--save", str(not_a_dir / "ckpt")], capsys)
    assert f"--save {not_a_dir / 'ckpt'} is not a writable directory" in line


def test_unwritable_data_cache_path_fails_at_parse_time(tmp_path, capsys):
    prefix = write_corpus(tmp_path / "corpus", num_documents=8, length=40)
    blocker = tmp_path / "cache"
    blocker.write_text("")  # a file where the directory should be
    line = parse_error(MODEL + NULL_TOKENIZER + ["--data-path", prefix, "--data-cache-path", str(blocker)], capsys)
    assert f"--data-cache-path {blocker} is not a writable directory" in line


def test_missing_save_directory_is_created(tmp_path):
    parse_args(TINY + ["--save", str(tmp_path / "new" / "ckpt")], add_difflm_args, world_size=1)
    assert (tmp_path / "new" / "ckpt").is_dir() and not list((tmp_path / "new" / "ckpt").iterdir())


def test_split_without_a_train_share(tmp_path, capsys):
    prefix = write_corpus(tmp_path / "corpus", num_documents=8, length=40)
    line = parse_error(MODEL + NULL_TOKENIZER + ["--data-path", prefix, "--split", "0,100,0"], capsys)
    assert "--split 0,100,0 gives the train split no documents" in line


def test_train_split_shorter_than_one_sample_exits_1_while_building(tmp_path, capsys):
    """Found only once the document lengths are read: InputError, turned into one line by pretrain()."""
    prefix = write_corpus(tmp_path / "corpus", num_documents=10, length=2)
    argv = MODEL + NULL_TOKENIZER + ["--data-path", prefix, "--split", "1,1,0", "--data-cache-path",
                                     str(tmp_path / "cache")]
    with pytest.raises(SystemExit) as exit_info:
        pretrain_difflm.main(argv)
    assert exit_info.value.code == 1
    line = error_line(capsys.readouterr().err)
    assert line.startswith("error: ") and f"{prefix}: the train split holds 10 tokens" in line
    assert "--seq-length 16" in line


# ---------------------------------------------------------------- the real command line
def test_cli_seq_length_zero():
    result = run_cli(*TINY, "--seq-length", "0")
    assert result.returncode == 2
    assert "--seq-length 0 must be >= 1" in error_line(result.stderr)


def test_cli_empty_train_split_exits_1_without_traceback(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", num_documents=2, length=40)
    result = run_cli(*MODEL, *NULL_TOKENIZER, "--data-path", prefix, "--split", "1,100,0",
                     "--data-cache-path", str(tmp_path / "cache"))
    assert result.returncode == 1, result.stderr[-2000:]
    line = error_line(result.stderr)
    assert line.startswith("error: --split 1,100,0 leaves the train split no documents")
    assert f"{prefix}: 2 documents" in line


def test_variable_length_cuts_that_sequence_parallelism_cannot_split(capsys):
    argv = TINY + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--difflm-varilen-prob", "0.1",
                   "--difflm-varilen-multiple", "3"]
    with pytest.raises(SystemExit):
        parse_args(argv, add_difflm_args, world_size=2)
    line = error_line(capsys.readouterr().err)
    assert "--difflm-varilen-multiple 3" in line and "pass --difflm-varilen-multiple 6" in line


def test_use_checkpoint_args_without_a_checkpoint(tmp_path, capsys):
    line = parse_error(TINY + ["--use-checkpoint-args", "--load", str(tmp_path)], capsys)
    assert "--use-checkpoint-args" in line and str(tmp_path) in line


# ---------------------------------------------------------------- resuming and saving
TRACKER = "latest_checkpointed_iteration.txt"
# Runs pretrain_difflm.py with every file DCP writes into iteration 4 failing as on a full disk.
DISK_FULL_AT_4 = """
import errno, os, sys
import torch.distributed.checkpoint.filesystem as dcp_filesystem
sys.path.insert(0, os.getcwd())
import pretrain_difflm
write_item = dcp_filesystem._write_item
def disk_full(transforms, stream, *args, **kwargs):
    if "iter_0000004" in getattr(stream, "name", ""):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write_item(transforms, stream, *args, **kwargs)
dcp_filesystem._write_item = disk_full
pretrain_difflm.main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """Iterations 2 and 4 of a finished run, saved by the command line (once per module)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    result = run_cli(*TINY, "--train-iters", "4", "--save", str(root), "--save-interval", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    return root


@pytest.fixture
def ckpt(saved_run, tmp_path) -> Path:
    return Path(shutil.copytree(saved_run, tmp_path / "ckpt"))


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_resuming_from_a_damaged_shard_names_it_and_the_iteration_to_load(ckpt, damage):
    shard = sorted((ckpt / "iter_0000004").glob("*.distcp"))[1]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100] if damage == "truncated" else b"\0" * size)
    result = run_cli(*TINY, "--train-iters", "6", "--load", str(ckpt))
    assert result.returncode == 1, result.stderr[-2000:]
    line = error_line(result.stderr)
    for part in (str(shard), "the checkpoint is damaged", "--ckpt-step 2", f"delete {ckpt / 'iter_0000004'}"):
        assert part in line, line
    if damage == "truncated":  # the sizes are checked before the model is built
        assert "100 bytes where the index expects" in line and "parameters" not in result.stdout
        return
    resumed = run_cli(*TINY, "--train-iters", "6", "--load", str(ckpt), "--ckpt-step", "2")
    assert resumed.returncode == 0 and "at iteration 2" in resumed.stdout, resumed.stderr[-2000:]


def test_resuming_with_another_vocabulary_names_the_vocabulary(ckpt):
    result = run_cli(*TINY, "--train-iters", "6", "--load", str(ckpt), "--vocab-size", "80")
    assert result.returncode == 1, result.stderr[-2000:]
    line = error_line(result.stderr)
    assert "tokenizer has vocab_size=65 but this run's has 81 (--vocab-size)" in line, line
    assert "mask" not in line, "the mask token moved because the vocabulary did"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_disk_filling_during_a_save_keeps_the_previous_checkpoint(tmp_path, mode):
    wrapper, root = tmp_path / "disk_full.py", tmp_path / "ckpt"
    wrapper.write_text(DISK_FULL_AT_4)
    flags = [*TINY, "--train-iters", "4", "--save", str(root), "--save-interval", "2"]
    result = subprocess.run([sys.executable, str(wrapper), *flags, *(["--async-save"] if mode == "async" else [])],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    line = error_line(result.stderr)
    for part in (f"--save {root}: saving iteration 4 failed (No space left on device)",
                 f"{TRACKER} still names iteration 2", "iter_0000004.tmp is never loaded", "free space"):
        assert part in line, line
    assert (root / TRACKER).read_text() == "2"
    assert sorted(path.name for path in root.iterdir()) == ["iter_0000002", TRACKER]
    resumed = run_cli(*TINY, "--train-iters", "4", "--load", str(root))
    assert resumed.returncode == 0 and "at iteration 2" in resumed.stdout, resumed.stderr[-2000:]
