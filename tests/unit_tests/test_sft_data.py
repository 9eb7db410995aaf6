"""SFT data: tools/preprocess_data.py --chat and megatron/training/tokenizer/chat_template.py."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from megatron.core.datasets.indexed_dataset import ANSWER_DTYPE, IndexedDataset, get_answer_prefix
from megatron.training.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer
from megatron.training.tokenizer import chat_template as chat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preprocess_data  # noqa: E402

SPM_MODEL = ROOT / "examples/data/tokenizer/spm_8k.model"
SPM = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(SPM_MODEL)]
THREE_TURNS = [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"},
               {"role": "user", "content": "Reverse: cat dog"}, {"role": "assistant", "content": "dog cat"},
               {"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "Lima"}]
ANSWERS = ["5", "dog cat", "Lima"]


@pytest.fixture(scope="module")
def spm():
    return SentencePieceTokenizer(str(SPM_MODEL))


def runs(ids, flags, value):
    """The maximal runs of consecutive tokens whose flag is `value`, as id lists."""
    found, current = [], []
    for token_id, flag in zip(list(ids) + [None], list(flags) + [None]):
        if flag == value:
            current.append(token_id)
        elif current:
            found.append(current)
            current = []
    return found


def encoder(tokenizer, source=chat.BUILTIN_TEMPLATE, turns="all", seed=1234):
    return chat.ChatEncoder(tokenizer, source, turns, seed)


def continued(spm, text):
    """Ids of `text` inside a longer string: spm_8k adds a dummy prefix '▁' at the start of a string only."""
    return spm.tokenize("\n" + text)[len(spm.tokenize("\n")):]


def test_builtin_template_answers_are_the_assistant_contents_plus_eod(spm):
    ids, flags = encoder(spm).encode_record({"messages": THREE_TURNS}, 1)[0]
    assert len(ids) == len(flags) and ids[0] == spm.bos and flags[0] == 0
    answers = runs(ids, flags, 1)
    assert answers == [continued(spm, text) + [spm.eod] for text in ANSWERS]
    assert [spm.detokenize(run) for run in answers] == ANSWERS  # the EOD control symbol decodes to ""
    assert runs(ids, flags, 0) == [
        [spm.bos] + spm.tokenize("<|system|>\nAnswer briefly.\n<|user|>\nWhat is 2 plus 3?\n<|assistant|>\n"),
        continued(spm, "<|user|>\nReverse: cat dog\n<|assistant|>\n"),
        continued(spm, "<|user|>\nCapital of Peru?\n<|assistant|>\n")]
    assert spm.detokenize(ids) == ("<|system|>\nAnswer briefly.\n<|user|>\nWhat is 2 plus 3?\n<|assistant|>\n5"
                                   "<|user|>\nReverse: cat dog\n<|assistant|>\ndog cat"
                                   "<|user|>\nCapital of Peru?\n<|assistant|>\nLima"), "no space at a boundary"


def test_plain_template_concatenates_prompt_and_response(spm):
    ids, flags = encoder(spm, chat.PLAIN_TEMPLATE).encode_record({"prompt": "Q: 2+3=", "completion": "5"}, 1)[0]
    prompt, answer = [spm.bos] + spm.tokenize("Q: 2+3="), continued(spm, "5") + [spm.eod]
    assert ids == prompt + answer and flags == [0] * len(prompt) + [1] * len(answer)
    assert spm.detokenize(ids) == "Q: 2+3=5"


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hf_folder(tmp_path, template, where="config", bos=None):
    """A tiny WordLevel tokenizer.json with ChatML specials, and its chat template in `where`."""
    words = ["[UNK]", "system", "user", "assistant", "Be", "brief", ".", "hi", "hello", "there", "!", "again"]
    specials = ["<|im_start|>", "<|im_end|>", "<s>"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", **({"bos_token": bos} if bos else {})}
    if where == "config":
        config["chat_template"] = template
    else:
        (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return HuggingFaceTokenizer(str(tmp_path))


@pytest.mark.parametrize("where", ["config", "jinja_file"])
def test_hf_chat_template_segments_and_boundary(tmp_path, where):
    tokenizer = hf_folder(tmp_path, CHATML, where)
    source, name = chat.resolve_template("auto", tokenizer)
    assert source == CHATML and name == "the tokenizer's chat_template"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there !"}]
    ids, flags = encoder(tokenizer, source).encode_record({"messages": messages}, 1)[0]
    prompt_text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt, answer = tokenizer.tokenize(prompt_text), tokenizer.tokenize("hello there !<|im_end|>\n")
    assert ids == prompt + answer, "no extra EOD: the answer already ends with <|im_end|> (the eos token)"
    assert flags == [0] * len(prompt) + [1] * len(answer)
    assert ids[len(prompt) - 1] == tokenizer.tokenize("assistant")[0], "the boundary is after the generation prompt"
    assert tokenizer.bos is None and tokenizer.eod == tokenizer.token_to_id("<|im_end|>")


def test_hf_template_that_renders_bos_gets_no_second_bos(tmp_path):
    tokenizer = hf_folder(tmp_path, "{{ bos_token }}" + CHATML, bos="<s>")
    ids, flags = encoder(tokenizer, chat.resolve_template("auto", tokenizer)[0]).encode_record(
        {"prompt": "hi", "response": "hello"}, 1)[0]
    assert ids[0] == tokenizer.bos and ids.count(tokenizer.bos) == 1 and flags[0] == 0


def test_template_that_rewrites_history_is_a_line_error(spm):
    rewrites = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}?{% endif %}"
    with pytest.raises(chat.ChatError, match=r"messages\[:1\] with the generation prompt is not a prefix"):
        encoder(spm, rewrites).encode_record({"prompt": "a", "response": "b"}, 1)


def test_chat_turns_all_sampled_each(spm):
    record = {"messages": THREE_TURNS}
    each = encoder(spm, turns="each").encode_record(record, 1)
    assert len(each) == 3
    for k, (ids, flags) in enumerate(each):
        assert runs(ids, flags, 1) == [continued(spm, ANSWERS[k]) + [spm.eod]], "only the k-th answer is a target"
        assert ids[-1] == spm.eod, "the example ends after its answer"
        text = spm.detokenize(ids)
        assert text.endswith(ANSWERS[k]) and all(f"\n{earlier}<|user|>" in text for earlier in ANSWERS[:k])
    assert each[2][0] == encoder(spm).encode_record(record, 1)[0][0], "'all' and the last 'each' share tokens"
    draws = [encoder(spm, turns="sampled").encode_record(record, n) for n in range(1, 31)]
    assert all(len(d) == 1 for d in draws)
    picked = [next(k for k in range(3) if d[0] == each[k]) for d in draws]
    assert len(set(picked)) == 3, "different lines draw different turns"
    assert picked == [next(k for k in range(3) if encoder(spm, turns="sampled").encode_record(record, n)[0] == each[k])
                      for n in range(1, 31)], "the draw depends only on (seed, line)"
    other_seed = [encoder(spm, turns="sampled", seed=7).encode_record(record, n)[0] for n in range(1, 31)]
    assert [next(k for k in range(3) if d == each[k]) for d in other_seed] != picked


def read_pairs(prefix):
    tokens = IndexedDataset(f"{prefix}_text_document")
    answers = IndexedDataset(get_answer_prefix(f"{prefix}_text_document"))
    assert answers.dtype == ANSWER_DTYPE and tokens.dtype == np.uint16
    assert np.array_equal(tokens.sequence_lengths, answers.sequence_lengths)
    assert np.array_equal(tokens.document_indices, answers.document_indices)
    return [(tokens[i].tolist(), answers[i].tolist()) for i in range(len(tokens))]


def test_tool_writes_both_pairs_and_chat_turns_each_counts(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps({"messages": THREE_TURNS}) for _ in range(4)) + "\n")
    counts = preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "each"), "--chat",
                                   "--chat-turns", "each", "--workers", "1", *SPM])
    examples = read_pairs(tmp_path / "each")
    assert counts["documents"] == len(examples) == 12
    assert [sum(flags) for _, flags in examples[:3]] == [sum(flags) for _, flags in examples[3:6]]
    assert examples[:3] == encoder(SentencePieceTokenizer(str(SPM_MODEL)), turns="each").encode_record(
        {"messages": THREE_TURNS}, 1)


BAD_LINES = [json.dumps({"text": "neither"}),
             json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
             json.dumps({"messages": "not a list"}),
             json.dumps({"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "x"}]})]


def test_records_and_malformed_lines(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    good = [json.dumps({"messages": THREE_TURNS}), json.dumps({"prompt": "2+2=", "response": "4"}),
            json.dumps({"prompt": "hi", "answer": "hello"})]
    source.write_text("\n".join(good[:2] + BAD_LINES + good[2:]) + "\n")
    counts = preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"), "--chat",
                                   "--workers", "1", *SPM])
    err = capsys.readouterr().err
    assert counts["documents"] == 3 and counts["skipped"] == 5
    for number, problem in ((3, "neither 'messages' nor 'prompt'"), (4, "messages[0] has no string 'content'"),
                            (5, "the conversation has no assistant turn"), (6, "'messages' is not a non-empty list"),
                            (7, "messages[0] has role 'human'")):
        assert f"{source}:{number}: {problem}" in err
    examples = read_pairs(tmp_path / "out")
    spm = SentencePieceTokenizer(str(SPM_MODEL))
    assert [spm.detokenize(runs(ids, flags, 1)[0]) for ids, flags in examples] == ["5", "4", "hello"]


def run_tool(args):
    return subprocess.run([sys.executable, str(ROOT / "tools/preprocess_data.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_strict_failure_keeps_the_earlier_pairs_and_writes_no_lone_answer_pair(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"messages": THREE_TURNS}) + "\n")
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + BAD_LINES[2] + "\n")
    preprocess_data.main(["--input", str(good), "--output-prefix", str(tmp_path / "out"), "--chat", "--workers", "1",
                          *SPM])
    before = {path.name: path.read_bytes() for path in tmp_path.glob("out*")}
    assert len(before) == 4
    for prefix in ("out", "fresh"):
        result = run_tool(["--input", str(bad), "--output-prefix", str(tmp_path / prefix), "--chat", "--strict",
                           "--workers", "1", *SPM])
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:2: the conversation has no assistant")
    assert {path.name: path.read_bytes() for path in tmp_path.glob("out*")} == before
    assert not list(tmp_path.glob("fresh*")), "a failed run writes no answer pair (nor token pair)"
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "plain text"}) + "\n")
    preprocess_data.main(["--input", str(plain), "--output-prefix", str(tmp_path / "out"), "--workers", "1", *SPM])
    assert sorted(path.name for path in tmp_path.glob("out*")) == ["out_text_document.bin", "out_text_document.idx"], \
        "a plain run over an SFT prefix removes the answer pair that no longer matches its tokens"


def test_chat_flags_need_chat_and_a_readable_template(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    for flags, message in ((["--chat-turns", "each"], "--chat-turns needs --chat"),
                           (["--chat", "--chat-template", str(tmp_path / "missing.jinja")], "missing.jinja: no such"),
                           (["--chat", "--json-keys", "body"], "--json-keys does not apply with --chat")):
        with pytest.raises(SystemExit) as raised:
            preprocess_data.get_args(["--input", str(source), "--output-prefix", str(tmp_path / "o"), *flags, *SPM])
        assert raised.value.code == 2
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="broken.jinja is not a valid jinja template"):
        chat.resolve_template(str(broken), None)


def test_partitions_give_identical_pairs(tmp_path):
    lines = (ROOT / "examples/data/chat_sample.jsonl").read_text().splitlines()[:200]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    outputs = []
    for name, flags in (("one", ["--workers", "1"]), ("two", ["--workers", "2", "--partitions", "2"])):
        preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / name), "--chat",
                              "--chat-turns", "sampled", *flags, *SPM])
        outputs.append([(tmp_path / f"{name}_text_document{suffix}").read_bytes()
                        for suffix in (".bin", ".idx", ".answer.bin", ".answer.idx")])
    assert outputs[0] == outputs[1]
    assert len(read_pairs(tmp_path / "one")) == 200
    assert not list(tmp_path.glob("*tmp*")) and not list(tmp_path.glob("*part*"))


def test_bundled_chat_sample_fits_and_is_rebuilt_byte_for_byte(tmp_path):
    import build_chat_sample  # tools/ is on sys.path (above)

    build_chat_sample.main(["--output", str(tmp_path / "train.jsonl"),
                            "--heldout-output", str(tmp_path / "held.jsonl")])
    for name, built in (("chat_sample.jsonl", "train.jsonl"), ("chat_sample_heldout.jsonl", "held.jsonl")):
        assert (tmp_path / built).read_bytes() == (ROOT / "examples/data" / name).read_bytes()
    train, held = (set((tmp_path / name).read_text().splitlines()) for name in ("train.jsonl", "held.jsonl"))
    assert len(train) == 1000 and len(held) == 100 and not train & held
    spm = SentencePieceTokenizer(str(SPM_MODEL))
    chat_encoder = encoder(spm)
    lengths = [len(chat_encoder.encode_record(json.loads(line), 1)[0][0]) for line in sorted(held)]
    assert max(lengths) < 256
