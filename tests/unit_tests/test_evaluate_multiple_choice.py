"""tools/evaluate_multiple_choice.py on CPU: every choice scored through log_likelihood, the
accuracy read off the best scores, the lm-eval token split, and clear errors for bad files."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import evaluate_multiple_choice as mc  # noqa: E402

pytest.importorskip("transformers")  # the checkpoint helpers of the conversion tests
from tests.unit_tests.test_hf_conversion import SPM, save_checkpoint, tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megatron.core.transformer.transformer_config import DLMConfig
    from megatron.training.tokenizer import SentencePieceTokenizer

    root = tmp_path_factory.mktemp("mc") / "ckpt"
    tokenizer = SentencePieceTokenizer(SPM)
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=tokenizer.mask)
    save_checkpoint(root, tiny_config(vocab_size=8192, unpadded_vocab_size=8192), dlm, tokenizer=tokenizer.identity)
    return root, tokenizer


def test_bundled_sample_scores_every_choice_and_reports_accuracy(checkpoint, tmp_path):
    root, tokenizer = checkpoint
    out = tmp_path / "report.json"
    report = mc.main(["--load", str(root), "--mc-num", "4", "--batch-size", "2", "--limit", "3",
                      "--device", "cpu", "--json", str(out)])
    assert report["questions"] == 3 and json.loads(out.read_text())["acc"] == report["acc"]
    questions = mc.read_questions(mc.SAMPLE, 3)
    model, _ = mc.load_inference_model(str(root), torch.device("cpu"))
    hits = 0
    for index, (item, question) in enumerate(zip(report["items"], questions)):
        assert len(item["scores"]) == len(question["choices"]) and all(score < 0 for score in item["scores"])
        # The first choice's score is the model's log_likelihood with this question's seed.
        context, answer = mc.split_tokens(tokenizer, question["context"], " " + question["choices"][0])
        expected = model.log_likelihood(torch.tensor(context), torch.tensor(answer), mc_num=4, batch_size=2,
                                        generator=torch.Generator().manual_seed(index))
        assert item["scores"][0] == pytest.approx(expected, abs=1e-9)
        assert item["prediction"] == max(range(len(item["scores"])), key=item["scores"].__getitem__)
        hits += item["prediction"] == question["label"]
    assert report["acc"] == pytest.approx(hits / 3)


def test_continuation_tokens_follow_the_context_ones(checkpoint):
    _, tokenizer = checkpoint
    context, answer = mc.split_tokens(tokenizer, "Fellow-Citizens of the Senate and House of", " Representatives")
    assert context + answer == tokenizer.tokenize("Fellow-Citizens of the Senate and House of Representatives")
    assert answer and context == tokenizer.tokenize("Fellow-Citizens of the Senate and House of")


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"context": "a", "choices": ["x"], "label": 0}', "'choices' must be a list of at least two"),
    ('{"context": "a", "choices": ["x", "y"], "label": 2}', "'label' must be the index"),
    ('{"choices": ["x", "y"], "label": 0}', "'context' must be a string"),
])
def test_bad_question_files_name_the_line(line, message, tmp_path, checkpoint, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"context": "a", "choices": ["x", "y"], "label": 1}\n' + line + "\n")
    with pytest.raises(SystemExit) as exit_info:
        mc.main(["--load", str(checkpoint[0]), "--data", str(data), "--device", "cpu"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"bad.jsonl:2: {message}" in error
