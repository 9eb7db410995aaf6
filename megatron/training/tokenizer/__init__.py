"""Tokenizers selected by --tokenizer-type, and the vocabulary padding the model embeds.

This package is imported by the preprocessing tool, so it stays free of torch and of the
training loop.
"""

from __future__ import annotations

from megatron.training.tokenizer.base import ADDED_MASK_TOKEN, MASK_TOKEN_NAMES, MegatronTokenizer
from megatron.training.tokenizer.gpt2_tokenizer import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
# Megatron-LM's names for tokenizers read by one of ours (both are SentencePiece models).
TOKENIZER_ALIASES = {"Llama2Tokenizer": "SentencePieceTokenizer", "GPTSentencePieceTokenizer": "SentencePieceTokenizer"}


def build_tokenizer(args) -> MegatronTokenizer:
    """Build the tokenizer named by ``args.tokenizer_type``.

    Reads ``tokenizer_model``, ``vocab_file``, ``merge_file``, ``vocab_size``, ``null_tokenizer_eod_id``,
    ``add_mask_token`` and ``mask_token`` from ``args`` when present (any Namespace works).
    """
    tokenizer_type = getattr(args, "tokenizer_type", None)
    tokenizer_type = TOKENIZER_ALIASES.get(tokenizer_type, tokenizer_type)
    mask = dict(add_mask_token=bool(getattr(args, "add_mask_token", False)),
                mask_token=getattr(args, "mask_token", None))
    if tokenizer_type == "NullTokenizer":
        vocab_size = getattr(args, "vocab_size", None)
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size, eod_id=getattr(args, "null_tokenizer_eod_id", None), **mask)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(getattr(args, "tokenizer_model", None), **mask)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(getattr(args, "tokenizer_model", None), **mask)
    if tokenizer_type == "GPT2BPETokenizer":
        vocab_file, merge_file = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
        if not vocab_file or not merge_file:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) "
                             "and --merge-file (merges.txt)")
        return GPT2BPETokenizer(vocab_file, merge_file, **mask)
    raise ValueError(f"--tokenizer-type {tokenizer_type} is not supported; "
                     f"choose one of {', '.join(TOKENIZER_TYPES)}")


def vocab_size_with_padding(vocab_size: int, make_vocab_size_divisible_by: int,
                            tensor_model_parallel_size: int = 1) -> int:
    """Round ``vocab_size`` up to a multiple of divisible_by * tp, so each tensor-parallel
    shard of the embedding is equal and matmul-friendly (as Megatron does)."""
    if vocab_size < 1:
        raise ValueError(f"vocab size {vocab_size} must be >= 1")
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by} and "
                         f"--tensor-model-parallel-size {tensor_model_parallel_size} must be >= 1")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


__all__ = [
    "add_tokenizer_args",
    "ADDED_MASK_TOKEN", "MASK_TOKEN_NAMES", "TOKENIZER_ALIASES", "TOKENIZER_TYPES", "MegatronTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "build_tokenizer",
    "vocab_size_with_padding",
]


def add_tokenizer_args(group, optional_type: bool = False) -> None:
    """The tokenizer flags, shared by pretrain_difflm.py and tools/preprocess_data.py. `optional_type`:
    --tokenizer-type may be left out (training: the type is then inferred from the files given, as
    Megatron's scripts expect, else NullTokenizer; compat_args.py)."""
    group.add_argument("--tokenizer-type", choices=list(TOKENIZER_TYPES) + list(TOKENIZER_ALIASES),
                       required=not optional_type,
                       help="Which tokenizer reads the text" + (" (default: the reader of --vocab-file/--merge-file "
                                                                "or --tokenizer-model, else NullTokenizer)."
                                                                if optional_type else "."))
    group.add_argument("--tokenizer-model", help="SentencePiece .model file, or a tokenizer.json or its folder.")
    group.add_argument("--vocab-file", help="GPT-2 BPE vocab.json.")
    group.add_argument("--merge-file", help="GPT-2 BPE merges.txt.")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size (the last id is EOD).")
    group.add_argument("--null-tokenizer-eod-id", type=int,
                       help="NullTokenizer's end-of-document id (default: --vocab-size minus 1, as megatron-core).")
    group.add_argument("--add-mask-token", action="store_true", help="Append a mask token to the vocabulary.")
