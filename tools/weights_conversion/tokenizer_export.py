"""Export the training tokenizer into a Hugging Face folder so `AutoTokenizer` loads it.

The checkpoint's metadata records the tokenizer's type, special ids and the sha256 of its
files (`MegatronTokenizer.identity`). The tokenizer exported is the one rebuilt from them
(megatron/training/tokenizer/identity.py): its files come from `--tokenizer-model` /
`--vocab-file` / `--merge-file` (or the identity's `files`, when it records them) and must hash
to the recorded sha256, so the export cannot silently ship another tokenizer.

Every type is written as a `tokenizer.json` (the `tokenizers` format, loaded by
`PreTrainedTokenizerFast` in every transformers version) plus `tokenizer_config.json` and
`special_tokens_map.json` naming eos/bos/pad/unk/mask. The original files are copied too
(`tokenizer.model`, `vocab.json` + `merges.txt`). A SentencePiece BPE or Unigram model is
rebuilt as a `tokenizers` pipeline with the same normalisation (dummy prefix, whitespace
escaping), merges ranked by piece score and byte fallback; the tests check it encodes real
text to the same ids. Special tokens inside text are parsed as special tokens by Hugging Face
(SentencePiece treats them as plain text); the training data never contains them as text.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

from megatron.training.tokenizer.base import ADDED_MASK_TOKEN, MegatronTokenizer


class TokenizerExportError(ValueError):
    pass


# ---------------------------------------------------------------------- SentencePiece -> tokenizers
def _spm_proto(model_file: str):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as handle:
        proto.ParseFromString(handle.read())
    return proto


_SPM_NORMAL, _SPM_UNKNOWN, _SPM_CONTROL, _SPM_USER_DEFINED, _SPM_BYTE = 1, 2, 3, 4, 6


def _spm_merges(pieces: List[tuple], vocab: Dict[str, int]) -> List[tuple]:
    """BPE merges that replay SentencePiece's choice: the pair whose concatenation is the
    vocabulary piece with the highest score merges first (ties: the lower id)."""
    candidates = []
    for piece, score, kind in pieces:
        if kind != _SPM_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, vocab[piece], vocab[left], vocab[right], left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


def spm_to_tokenizers(model_file: str) -> Tokenizer:
    """A `tokenizers` pipeline that encodes text to the same ids as the SentencePiece model."""
    proto = _spm_proto(model_file)
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    if spec.name not in ("identity", "") or spec.precompiled_charsmap:
        raise TokenizerExportError(f"SentencePiece normalizer {spec.name!r} has no tokenizers equivalent here; "
                                   "only identity normalisation is exported")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    vocab = {piece: index for index, (piece, _, _) in enumerate(pieces)}
    unk = trainer.unk_piece or "<unk>"
    if trainer.model_type == 2:  # BPE
        model = models.BPE(vocab=vocab, merges=_spm_merges(pieces, vocab), unk_token=unk,
                           byte_fallback=trainer.byte_fallback, fuse_unk=True)
    elif trainer.model_type == 1:  # Unigram
        model = models.Unigram([(piece, score) for piece, score, _ in pieces], unk_id=vocab.get(unk),
                               byte_fallback=trainer.byte_fallback)
    else:
        raise TokenizerExportError(f"SentencePiece model type {trainer.model_type} (word/char) is not exported")
    tokenizer = Tokenizer(model)
    steps = []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("▁", " ")]
    if trainer.byte_fallback:
        decode.append(decoders.ByteFallback())
    decode.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    specials = [AddedToken(piece, special=True, normalized=False)
                for piece, _, kind in pieces if kind in (_SPM_CONTROL, _SPM_UNKNOWN)]
    tokenizer.add_special_tokens(specials)
    return tokenizer


# ---------------------------------------------------------------------- the export
def _token_string(tokenizer: MegatronTokenizer, token_id: Optional[int]) -> Optional[str]:
    if token_id is None:
        return None
    if tokenizer.mask_is_added and token_id == tokenizer.mask:
        return ADDED_MASK_TOKEN
    if hasattr(tokenizer, "_processor"):
        return tokenizer._processor.id_to_piece(token_id)
    return tokenizer._tokenizer.id_to_token(token_id)


def _fast_tokenizer(tokenizer: MegatronTokenizer, output_dir: str) -> Tokenizer:
    """The training tokenizer as a `tokenizers.Tokenizer`; copies its original files alongside."""
    kind = tokenizer.type_name
    if kind == "SentencePieceTokenizer":
        shutil.copyfile(tokenizer.model_file, os.path.join(output_dir, "tokenizer.model"))
        return spm_to_tokenizers(tokenizer.model_file)
    if kind == "GPT2BPETokenizer":
        shutil.copyfile(tokenizer.vocab_file, os.path.join(output_dir, "vocab.json"))
        shutil.copyfile(tokenizer.merge_file, os.path.join(output_dir, "merges.txt"))
    return Tokenizer.from_str(tokenizer._tokenizer.to_str())


def export_tokenizer(tokenizer: MegatronTokenizer, output_dir: str, model_max_length: int) -> Dict[str, object]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; returns the
    special token ids for config.json and generation_config.json."""
    fast = _fast_tokenizer(tokenizer, output_dir)
    specials = {"eos_token": _token_string(tokenizer, tokenizer.eod),
                "pad_token": _token_string(tokenizer, tokenizer.pad),
                "bos_token": _token_string(tokenizer, tokenizer.bos),
                "mask_token": _token_string(tokenizer, tokenizer.mask)}
    if tokenizer.type_name == "SentencePieceTokenizer":
        unk = tokenizer._processor.unk_id()
        specials["unk_token"] = tokenizer._processor.id_to_piece(unk) if unk >= 0 else None
    specials = {name: value for name, value in specials.items() if value is not None}
    fast.add_special_tokens([AddedToken(value, special=True, normalized=False) for value in specials.values()])
    if tokenizer.mask is not None and fast.token_to_id(specials["mask_token"]) != tokenizer.mask:
        raise TokenizerExportError(f"the exported tokenizer gives the mask token {specials['mask_token']!r} id "
                                   f"{fast.token_to_id(specials['mask_token'])}, the model uses {tokenizer.mask}")
    fast.save(os.path.join(output_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **specials}
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    with open(os.path.join(output_dir, "special_tokens_map.json"), "w") as handle:
        json.dump(specials, handle, indent=2)
    return {"eos_token_id": tokenizer.eod, "pad_token_id": tokenizer.pad, "bos_token_id": tokenizer.bos,
            "mask_token_id": tokenizer.mask}
