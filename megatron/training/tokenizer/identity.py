"""The tokenizer a checkpoint was trained with, rebuilt from the identity its metadata records
(`MegatronTokenizer.identity`: type, special ids, the sha256 of its files and, when known, their
paths). The files come from the caller's flags or from the recorded paths and must hash to the
recorded sha256, so a tool never silently reads text with another tokenizer.

The evaluation (megatron/evaluation/lm_eval_adapter.py), generation and the conversion tools all
rebuild tokenizers this way.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron.training.tokenizer import build_tokenizer
from megatron.training.tokenizer.base import MegatronTokenizer, sha256_of_files

__all__ = ["NO_FILES", "TokenizerIdentityError", "rebuild_training_tokenizer", "tokenizer_source_args"]

NO_FILES = "NullTokenizer"


class TokenizerIdentityError(ValueError):
    """The recorded identity cannot be matched: files missing, of another hash, or other special ids."""


def tokenizer_source_args(identity: dict, tokenizer_model: Optional[str] = None, vocab_file: Optional[str] = None,
                          merge_file: Optional[str] = None):
    """The namespace `build_tokenizer` needs to rebuild the training tokenizer, from the flags
    or from the files the identity records; raises when neither names the files."""
    kind = identity.get("type")
    files = identity.get("files") or []
    if kind == "SentencePieceTokenizer" or kind == "HuggingFaceTokenizer":
        recorded = files[0] if files else None
        if kind == "HuggingFaceTokenizer" and len(files) > 1:
            # tokenizer.json plus its folder's config files: it was loaded from the folder.
            recorded = os.path.dirname(files[0])
        tokenizer_model = tokenizer_model or recorded
        if not tokenizer_model:
            raise TokenizerIdentityError(
                f"the checkpoint was trained with a {kind} (sha256 {identity.get('sha256')}) but does not record "
                "its files; pass --tokenizer-model (the file given to training), or --no-tokenizer")
    elif kind == "GPT2BPETokenizer":
        vocab_file = vocab_file or (files[0] if len(files) == 2 else None)
        merge_file = merge_file or (files[1] if len(files) == 2 else None)
        if not (vocab_file and merge_file):
            raise TokenizerIdentityError("the checkpoint was trained with a GPT2BPETokenizer; pass --vocab-file "
                                         "and --merge-file (the files given to training), or --no-tokenizer")
    elif kind != NO_FILES:
        raise TokenizerIdentityError(f"tokenizer type {kind!r} recorded in the checkpoint is not one of "
                                     "SentencePieceTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer")
    return argparse.Namespace(tokenizer_type=kind, tokenizer_model=tokenizer_model, vocab_file=vocab_file,
                              merge_file=merge_file, vocab_size=identity.get("vocab_size"),
                              mask_token=identity.get("mask"), add_mask_token=_mask_was_appended(identity))


def _mask_was_appended(identity: dict) -> bool:
    """The identity's vocab size counts an appended mask id (it is then the last id)."""
    mask, size = identity.get("mask"), identity.get("vocab_size")
    return mask is not None and size is not None and mask == size - 1 and identity.get("type") != NO_FILES


def rebuild_training_tokenizer(identity: dict, **paths) -> Optional[MegatronTokenizer]:
    """The tokenizer of the checkpoint, checked against the recorded sha256; None for the NullTokenizer."""
    if identity.get("type") == NO_FILES:
        return None
    args = tokenizer_source_args(identity, **paths)
    if args.add_mask_token:
        # A recorded mask id equal to the base size means it was appended by --add-mask-token.
        args.mask_token = identity["mask"]
    tokenizer = build_tokenizer(args)
    recorded, actual = identity.get("sha256"), sha256_of_files(tokenizer._source_files())
    if recorded and actual != recorded:
        raise TokenizerIdentityError(f"tokenizer files {tokenizer._source_files()} hash to {actual}, but the "
                                     f"checkpoint was trained with sha256 {recorded}; pass the training "
                                     "tokenizer's files")
    for name in ("vocab_size", "eod", "mask"):
        if identity.get(name) is not None and getattr(tokenizer, name) != identity[name]:
            raise TokenizerIdentityError(f"tokenizer {name}={getattr(tokenizer, name)} but the checkpoint "
                                         f"recorded {identity[name]}; pass the training tokenizer's files and "
                                         "mask settings")
    return tokenizer
