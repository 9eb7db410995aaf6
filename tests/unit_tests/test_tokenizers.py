"""Tokenizers built from tiny local files that the tests train themselves (no network)."""

import json
import os
import shutil
from argparse import Namespace

import pytest
import sentencepiece
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from megatron.training.tokenizer import (
    ADDED_MASK_TOKEN, GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer,
    SentencePieceTokenizer, build_tokenizer, vocab_size_with_padding,
)

SAMPLE = "the quick brown fox jumps over the lazy dog."
CORPUS = [
    SAMPLE,
    "a masked diffusion model predicts the hidden tokens of a sentence.",
    "pack my box with five dozen liquor jugs, then sleep.",
    "how vexingly quick daft zebras jump over sleepy wizards!",
    "sphinx of black quartz, judge my vow; 0123456789 times.",
] * 20


# ----- tiny tokenizer files ----------------------------------------------------------------

def train_sentencepiece(folder, name="sp", vocab_size=120, **options):
    folder.mkdir(parents=True, exist_ok=True)
    prefix = str(folder / name)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=prefix, vocab_size=vocab_size,
        model_type="bpe", hard_vocab_limit=False, character_coverage=1.0,
        minloglevel=2, **options)
    return prefix + ".model"


def train_byte_bpe(special_tokens, vocab_size=400):
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def save_hf(folder, special_tokens=("<|endoftext|>",), configs=None, vocab_size=400, wrap=None):
    """Write folder/tokenizer.json and optional config files; return the folder. ``wrap``
    (bos, eos) adds a Llama-style post-processor that surrounds encodings with them."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_byte_bpe(special_tokens, vocab_size)
    if wrap:
        bos, eos = wrap
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(t, tokenizer.token_to_id(t)) for t in wrap])
    tokenizer.save(str(folder / "tokenizer.json"))
    for name, content in (configs or {}).items():
        (folder / name).write_text(json.dumps(content))
    return folder


def save_gpt2(folder, special_tokens=("<|endoftext|>",), vocab_size=400):
    """Write folder/vocab.json and folder/merges.txt; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    train_byte_bpe(special_tokens, vocab_size).model.save(str(folder))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return Namespace(
        root=root,
        sp=train_sentencepiece(root / "sp"),
        sp_mask=train_sentencepiece(root / "sp_mask", user_defined_symbols=["<|mdm_mask|>"]),
        hf=save_hf(root / "hf"),
        hf_mask=save_hf(root / "hf_mask", ("<|endoftext|>", "<|mdm_mask|>")),
        gpt2=save_gpt2(root / "gpt2"),
        gpt2_mask=save_gpt2(root / "gpt2_mask", ("<|endoftext|>", "<|mdm_mask|>")),
    )


def build(tokenizer_type, **kwargs):
    return build_tokenizer(Namespace(tokenizer_type=tokenizer_type, **kwargs))


def build_each(files, variant=""):
    """One tokenizer of each file-backed type, optionally from the '_mask' files."""
    gpt2_vocab, gpt2_merges = getattr(files, "gpt2" + variant)
    return {
        "sp": build("SentencePieceTokenizer", tokenizer_model=getattr(files, "sp" + variant)),
        "hf": build("HuggingFaceTokenizer", tokenizer_model=str(getattr(files, "hf" + variant))),
        "gpt2": build("GPT2BPETokenizer", vocab_file=gpt2_vocab, merge_file=gpt2_merges),
    }


# ----- behaviour common to the file-backed tokenizers ---------------------------------------

def test_round_trip_and_no_mask_by_default(files):
    for kind, tokenizer in build_each(files).items():
        ids = tokenizer.tokenize(SAMPLE)
        assert ids and all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids), kind
        assert tokenizer.detokenize(ids) == SAMPLE, kind
        assert tokenizer.mask is None and tokenizer.vocab_size == tokenizer.base_vocab_size, kind
        assert tokenizer.eod not in ids, f"{kind}: tokenize must not add special tokens"


def test_mask_found_in_vocabulary(files):
    for kind, tokenizer in build_each(files, "_mask").items():
        expected = tokenizer.token_to_id("<|mdm_mask|>")
        assert expected is not None, kind
        with_add = {"sp": build("SentencePieceTokenizer", tokenizer_model=files.sp_mask, add_mask_token=True),
                    "hf": build("HuggingFaceTokenizer", tokenizer_model=str(files.hf_mask), add_mask_token=True),
                    "gpt2": build("GPT2BPETokenizer", vocab_file=files.gpt2_mask[0],
                                  merge_file=files.gpt2_mask[1], add_mask_token=True)}[kind]
        for candidate in (tokenizer, with_add):
            assert candidate.mask == expected, f"{kind}: the vocabulary's mask token wins over adding one"
            assert candidate.vocab_size == candidate.base_vocab_size and not candidate.mask_is_added


def test_added_mask_token_is_appended_and_rendered(files):
    plain = build_each(files)
    added = {
        "sp": build("SentencePieceTokenizer", tokenizer_model=files.sp, add_mask_token=True),
        "hf": build("HuggingFaceTokenizer", tokenizer_model=str(files.hf), add_mask_token=True),
        "gpt2": build("GPT2BPETokenizer", vocab_file=files.gpt2[0], merge_file=files.gpt2[1],
                      add_mask_token=True),
    }
    for kind, tokenizer in added.items():
        base = plain[kind].vocab_size
        assert tokenizer.mask == base and tokenizer.vocab_size == base + 1, kind
        assert tokenizer.mask_is_added
        ids = tokenizer.tokenize(SAMPLE + " " + ADDED_MASK_TOKEN)
        assert tokenizer.mask not in ids, f"{kind}: tokenize never produces an appended mask id"
        sample_ids = tokenizer.tokenize(SAMPLE)
        text = tokenizer.detokenize(sample_ids[:3] + [tokenizer.mask, tokenizer.mask] + sample_ids[3:])
        assert text.count(ADDED_MASK_TOKEN) == 2, (kind, text)
        assert tokenizer.detokenize([tokenizer.mask]) == ADDED_MASK_TOKEN
        assert tokenizer.identity["vocab_size"] == base + 1 and tokenizer.identity["mask"] == base


def test_mask_override_is_checked_against_the_vocabulary(files):
    for kind, tokenizer in build_each(files).items():
        base = tokenizer.vocab_size
        kwargs = {"sp": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=files.sp),
                  "hf": dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(files.hf)),
                  "gpt2": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=files.gpt2[0],
                               merge_file=files.gpt2[1])}[kind]
        chosen = build(mask_token=7, **kwargs)
        assert chosen.mask == 7 and chosen.vocab_size == base, kind
        assert build(mask_token=7, add_mask_token=True, **kwargs).vocab_size == base, \
            f"{kind}: an override inside the vocabulary adds nothing"
        appended = build(mask_token=base, add_mask_token=True, **kwargs)
        assert appended.mask == base and appended.vocab_size == base + 1
        with pytest.raises(ValueError, match=rf"--mask-token {base}\b.*size {base}"):
            build(mask_token=base, **kwargs)
        with pytest.raises(ValueError, match="--mask-token"):
            build(mask_token=-1, **kwargs)


def without_files(identity: dict) -> dict:
    return {key: value for key, value in identity.items() if key != "files"}


def test_identity_is_json_and_follows_file_content(files, tmp_path):
    for kind, tokenizer in build_each(files).items():
        identity = tokenizer.identity
        assert json.loads(json.dumps(identity)) == identity
        assert identity["type"] == type(tokenizer).type_name and len(identity["sha256"]) == 64
        assert (identity["vocab_size"], identity["eod"], identity["mask"]) == \
            (tokenizer.vocab_size, tokenizer.eod, None)
        # Where it came from: the absolute paths of the files that were hashed.
        assert identity["files"] == [os.path.abspath(path) for path in tokenizer._source_files()]
        assert all(os.path.isabs(path) and os.path.isfile(path) for path in identity["files"])
    # Same bytes elsewhere: same sha256 (the files differ). Different bytes: different sha256.
    moved = tmp_path / "moved.model"
    shutil.copy(files.sp, moved)
    original = SentencePieceTokenizer(files.sp).identity
    relocated = SentencePieceTokenizer(str(moved)).identity
    assert relocated["files"] == [str(moved)] and relocated["files"] != original["files"]
    assert without_files(relocated) == without_files(original)
    retrained = train_sentencepiece(tmp_path, "other", vocab_size=100)
    assert SentencePieceTokenizer(retrained).identity["sha256"] != original["sha256"]

    hf_copy = tmp_path / "hf_copy"
    shutil.copytree(files.hf, hf_copy)
    same = HuggingFaceTokenizer(str(hf_copy)).identity
    assert without_files(same) == without_files(HuggingFaceTokenizer(str(files.hf)).identity)
    assert same["files"][0] == str(hf_copy / "tokenizer.json")
    content = json.loads((hf_copy / "tokenizer.json").read_text())
    content["model"]["merges"] = content["model"]["merges"][:-1]
    (hf_copy / "tokenizer.json").write_text(json.dumps(content))
    assert HuggingFaceTokenizer(str(hf_copy)).identity["sha256"] != same["sha256"]

    vocab, merges = files.gpt2
    shutil.copy(vocab, tmp_path / "vocab.json")
    lines = open(merges, encoding="utf-8").read().splitlines()
    (tmp_path / "merges.txt").write_text("\n".join(lines[:-1]) + "\n")
    before = GPT2BPETokenizer(vocab, merges).identity["sha256"]
    assert GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")).identity["sha256"] != before


# ----- per-type special ids ----------------------------------------------------------------

def test_sentencepiece_special_ids(files, tmp_path):
    tokenizer = SentencePieceTokenizer(files.sp)
    assert (tokenizer.eod, tokenizer.bos, tokenizer.pad) == (2, 1, 2), "default unk=0 bos=1 eos=2, no pad"
    with_pad = SentencePieceTokenizer(train_sentencepiece(tmp_path, "pad", pad_id=3))
    assert with_pad.pad == 3 and with_pad.eod == 2
    no_bos = SentencePieceTokenizer(train_sentencepiece(tmp_path, "nobos", bos_id=-1, eos_id=1))
    assert no_bos.bos is None and no_bos.eod == 1
    named = SentencePieceTokenizer(train_sentencepiece(
        tmp_path, "named", eos_id=-1, user_defined_symbols=["<|endoftext|>"]))
    assert named.eod == named.token_to_id("<|endoftext|>"), "no eos id: eod is found by name"
    with pytest.raises(ValueError, match="no eos id"):
        SentencePieceTokenizer(train_sentencepiece(tmp_path, "noeos", eos_id=-1))
    assert tokenizer.token_to_id("<|mdm_mask|>") is None, "unknown pieces are not the unk id"


def test_huggingface_special_ids_from_config_files(tmp_path):
    specials = ("<s>", "</s>", "<pad>", "<|endoftext|>", "<my_mask>", "<|mdm_mask|>")
    folder = save_hf(tmp_path / "cfg", specials, configs={
        "tokenizer_config.json": {"eos_token": "<|endoftext|>", "bos_token": {"content": "<s>"},
                                  "pad_token": "<pad>", "chat_template": "{{ x }}"},
        "special_tokens_map.json": {"eos_token": {"content": "</s>", "lstrip": False},
                                    "mask_token": "<my_mask>"},
    }, wrap=("<s>", "</s>"))
    tokenizer = HuggingFaceTokenizer(str(folder))
    ids = {name: tokenizer.token_to_id(name) for name in specials}
    assert tokenizer.eod == ids["</s>"], "special_tokens_map.json overrides tokenizer_config.json"
    assert (tokenizer.bos, tokenizer.pad) == (ids["<s>"], ids["<pad>"])
    assert tokenizer.mask == ids["<my_mask>"], "a configured mask token wins over the known names"
    assert len(tokenizer.config_files) == 2
    sample_ids = tokenizer.tokenize(SAMPLE)
    assert ids["<s>"] not in sample_ids and ids["</s>"] not in sample_ids, "no post-processor specials"
    assert tokenizer.detokenize(sample_ids) == SAMPLE

    # A lone tokenizer.json has no config: eod by name, no bos, pad falls back to eod.
    alone = HuggingFaceTokenizer(str(folder / "tokenizer.json"))
    assert (alone.eod, alone.bos, alone.pad) == (ids["<|endoftext|>"], None, ids["<|endoftext|>"])
    assert alone.mask == ids["<|mdm_mask|>"]

    chat = HuggingFaceTokenizer(str(save_hf(tmp_path / "chat", ("<|im_end|>", "</s>"))))
    assert chat.eod == chat.token_to_id("</s>"), "'</s>' comes before '<|im_end|>'"
    with pytest.raises(ValueError, match="no eos token"):
        HuggingFaceTokenizer(str(save_hf(tmp_path / "noeos", ("<unk>",))))


def test_gpt2_special_ids(files, tmp_path):
    tokenizer = GPT2BPETokenizer(*files.gpt2)
    vocab = json.load(open(files.gpt2[0], encoding="utf-8"))
    assert tokenizer.eod == vocab["<|endoftext|>"] and tokenizer.pad == tokenizer.eod
    assert tokenizer.bos is None and tokenizer.vocab_size == len(vocab)
    assert tokenizer.eod not in tokenizer.tokenize("a<|endoftext|>b"), "eod only comes from --append-eod"
    assert tokenizer.detokenize([tokenizer.eod]) == "<|endoftext|>"
    with pytest.raises(ValueError, match=r"--vocab-file .*no <\|endoftext\|>"):
        GPT2BPETokenizer(*save_gpt2(tmp_path / "noeod", ("<unk>",)))


def test_null_tokenizer():
    tokenizer = build("NullTokenizer", vocab_size=10)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, tokenizer.bos, tokenizer.mask) == (10, 9, 9, None, None)
    assert tokenizer.tokenize("1 2 9") == [1, 2, 9] and tokenizer.detokenize([1, 2, 9]) == "1 2 9"
    added = build("NullTokenizer", vocab_size=10, add_mask_token=True)
    assert (added.vocab_size, added.eod, added.mask) == (11, 9, 10)
    assert added.tokenize(added.detokenize([3, 10, 4])) == [3, 10, 4]
    assert build("NullTokenizer", vocab_size=10, mask_token=4).mask == 4
    with pytest.raises(ValueError, match="--mask-token 10"):
        build("NullTokenizer", vocab_size=10, mask_token=10)
    assert NullTokenizer(10, add_mask_token=True).identity == \
        {"type": "NullTokenizer", "vocab_size": 11, "eod": 9, "mask": 10, "sha256": None}


def test_null_tokenizer_eod_id_names_another_end_of_document():
    """--null-tokenizer-eod-id (megatron-core's flag): EOD anywhere in the vocabulary; the mask token
    is still appended after the last id, and the checkpoint identity records the EOD chosen."""
    tokenizer = build("NullTokenizer", vocab_size=10, null_tokenizer_eod_id=0, add_mask_token=True)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.mask) == (11, 0, 10)
    assert tokenizer.identity["eod"] == 0
    assert build("NullTokenizer", vocab_size=10, null_tokenizer_eod_id=None).eod == 9
    for outside in (10, -1):
        with pytest.raises(ValueError, match=f"--null-tokenizer-eod-id {outside} is outside the vocabulary"):
            build("NullTokenizer", vocab_size=10, null_tokenizer_eod_id=outside)


# ----- padding and errors ------------------------------------------------------------------

def test_vocab_size_with_padding():
    assert vocab_size_with_padding(50289, 128) == 50304
    assert vocab_size_with_padding(50289, 128, 2) == 50432
    assert vocab_size_with_padding(50304, 128) == 50304
    assert vocab_size_with_padding(61, 128) == 128 and vocab_size_with_padding(1, 1) == 1
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        vocab_size_with_padding(100, 0)


def test_missing_files_name_the_flag_and_path(files, tmp_path):
    missing = str(tmp_path / "nowhere" / "tokenizer.model")
    with pytest.raises(FileNotFoundError, match=rf"--tokenizer-model {missing}"):
        build("SentencePieceTokenizer", tokenizer_model=missing)
    with pytest.raises(FileNotFoundError, match=rf"--tokenizer-model {missing}"):
        build("HuggingFaceTokenizer", tokenizer_model=missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tokenizer.model").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"{empty}.*no tokenizer.json.*SentencePieceTokenizer"):
        build("HuggingFaceTokenizer", tokenizer_model=str(empty))
    with pytest.raises(FileNotFoundError, match=rf"--vocab-file {missing}"):
        build("GPT2BPETokenizer", vocab_file=missing, merge_file=files.gpt2[1])
    with pytest.raises(FileNotFoundError, match=rf"--merge-file {missing}"):
        build("GPT2BPETokenizer", vocab_file=files.gpt2[0], merge_file=missing)
    with pytest.raises(ValueError, match="--tokenizer-model is required"):
        build("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="--merge-file"):
        build("GPT2BPETokenizer", vocab_file=files.gpt2[0])
    with pytest.raises(ValueError, match="--vocab-size"):
        build("NullTokenizer")
    with pytest.raises(ValueError, match="--tokenizer-type Bogus is not supported"):
        build("Bogus")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=rf"--tokenizer-model {garbage}"):
        build("SentencePieceTokenizer", tokenizer_model=str(garbage))


def test_package_stays_light():
    import subprocess
    import sys
    code = ("import sys, megatron.training.tokenizer; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or m == 'megatron.training.training']; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0, result.stderr
