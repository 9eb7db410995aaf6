"""Tokenizers selected by --tokenizer-type."""

from megatron.training.tokenizer.null_tokenizer import NullTokenizer


def build_tokenizer(args):
    if args.tokenizer_type == "NullTokenizer":
        return NullTokenizer(args.vocab_size, add_mask_token=args.add_mask_token)
    raise ValueError(f"--tokenizer-type {args.tokenizer_type} is not supported")


__all__ = ["NullTokenizer", "build_tokenizer"]
