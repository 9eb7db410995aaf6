"""SFT end to end on the bundled chat sample: tools/preprocess_data.py --chat, a starting
checkpoint pretrained on the same text without --sft, then `--load START --finetune --sft`. The
held-out conversations' answer loss (the DLM's ELBO bound per answer token) must fall well below
the starting checkpoint's. (AR fine-tuning trains the same rows: tests/unit_tests/test_sft.py and
tests/distributed/test_sft_parity.py.)"""

import importlib.util
from pathlib import Path

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_answer_prefix
from tests.unit_tests.test_training import make_trainer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
TOKENIZER = ["--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", str(DATA / "tokenizer" / "spm_8k.model")]
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--seq-length", "64",
         "--attention-backend", "math", "--add-mask-token", "--micro-batch-size", "8", "--global-batch-size", "8",
         "--log-interval", "1000", "--lr", "3e-3", "--min-lr", "3e-3", "--lr-decay-style", "constant", "--seed", "7",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def preprocess(source: Path, prefix: Path) -> str:
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "tools" / "preprocess_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--chat", "--input", str(source), "--output-prefix", str(prefix), "--workers", "1", *TOKENIZER])
    return f"{prefix}_text_document"


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    train, heldout = preprocess(DATA / "chat_sample.jsonl", root / "train"), preprocess(
        DATA / "chat_sample_heldout.jsonl", root / "heldout")
    return root, train, heldout


def test_sft_raises_the_answer_likelihood_of_heldout_conversations(runtime, chat_data, mode="difflm-noshift"):
    root, train, heldout = chat_data
    assert IndexedDataset.exists(get_answer_prefix(train))
    start = root / f"start-{mode}"
    mode_flags = ["--model-running-mode", mode]
    pretrained = make_trainer(runtime, *SHAPE, *TOKENIZER, *mode_flags, "--train-data-path", train,
                              "--train-iters", "4", "--eval-iters", "0", "--save", str(start),
                              "--save-interval", "4", base=[])
    pretrained.train()
    sft = make_trainer(runtime, *SHAPE, *TOKENIZER, *mode_flags, "--sft", "--train-data-path", train,
                       "--valid-data-path", heldout, "--eval-iters", "4", "--eval-interval", "1000",
                       "--train-iters", "16", "--load", str(start), "--finetune", base=[])
    before = sft.evaluate()
    sft.train()
    after = sft.evaluate()
    assert after < 0.8 * before, (mode, before, after)
