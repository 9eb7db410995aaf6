"""Validation of the data flags: the paths (or the files listing them), the split, and the
tokenizer the data is read with (arguments.validate_args calls `validate_data_args`)."""

from __future__ import annotations

import argparse
import json


def _read_data_args(args: argparse.Namespace) -> None:
    """--data-args-path / --per-split-data-args-path: the data paths from a file (Megatron's long blends)."""
    if args.data_args_path:
        if args.data_path:
            raise ValueError("give --data-path or --data-args-path, not both")
        with open(args.data_args_path) as handle:
            args.data_path = handle.read().split()
    if args.per_split_data_args_path:
        if any([args.train_data_path, args.valid_data_path, args.test_data_path]):
            raise ValueError("give --train/valid/test-data-path or --per-split-data-args-path, not both")
        with open(args.per_split_data_args_path) as handle:
            try:
                splits = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"--per-split-data-args-path {args.per_split_data_args_path} is not JSON "
                                 f"({error})") from None
        if not isinstance(splits, dict) or "train" not in splits:
            raise ValueError(f"--per-split-data-args-path {args.per_split_data_args_path} must hold a JSON object "
                             'with a "train" key (and optional "valid", "test")')
        for split in ("train", "valid", "test"):
            value = splits.get(split)
            setattr(args, f"{split}_data_path", value.split() if isinstance(value, str) else value)


def _data_flags(args: argparse.Namespace):
    """(flag, its values) of each data-path flag given."""
    flags = (("--data-path", args.data_path), ("--train-data-path", args.train_data_path),
             ("--valid-data-path", args.valid_data_path), ("--test-data-path", args.test_data_path))
    return [(flag, values) for flag, values in flags if values]


def validate_data_args(args: argparse.Namespace) -> None:
    """The data flags (paths, split, mock data) and the tokenizer they are read with; sets args.tokenizer,
    args.padded_vocab_size and args.mask_token."""
    from megatron.core.datasets.dataset_builder import check_leading_tokens, check_prefixes_exist, parse_data_paths
    from megatron.core.datasets.gpt_dataset import split_weights
    from megatron.training.tokenizer import build_tokenizer, vocab_size_with_padding

    _read_data_args(args)
    split_paths = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if args.mock_data and (args.data_path or any(split_paths)):
        raise ValueError("--mock-data and --data-path/--train-data-path are exclusive; choose one")
    if not args.mock_data:
        if args.data_path and any(split_paths):
            raise ValueError("give either --data-path (with --split) or --train/valid/test-data-path, not both")
        if not args.data_path and not args.train_data_path:
            raise ValueError("no training data: pass --data-path PREFIX (from tools/preprocess_data.py) or --mock-data")
        if args.data_path and split_weights(args.split)[0] == 0:
            raise ValueError(f"--split {args.split} gives the train split no documents; give its first (train) "
                             "weight a positive value")
        for flag, values in _data_flags(args):
            check_prefixes_exist(parse_data_paths(values, flag)[0], flag, sft=getattr(args, "sft", False))
    elif args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--mock-data with the NullTokenizer needs --vocab-size")
    args.tokenizer = build_tokenizer(args)
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer" \
            and args.vocab_size != args.tokenizer.vocab_size:
        raise ValueError(f"--vocab-size {args.vocab_size} is not the size of --tokenizer-type {args.tokenizer_type}'s "
                         f"vocabulary ({args.tokenizer.vocab_size}); drop --vocab-size (padding is "
                         "--make-vocab-size-divisible-by) or fix it")
    if not args.mock_data:
        for flag, values in _data_flags(args):
            check_leading_tokens(parse_data_paths(values, flag)[0], flag, args.tokenizer.base_vocab_size)
    args.padded_vocab_size = vocab_size_with_padding(args.tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                                     args.tensor_model_parallel_size)
    # --mask-token is a DLM flag (custom_args/difflm.py): absent when the library parses Megatron's flags alone.
    requested_mask, args.mask_token = getattr(args, "mask_token", None), args.tokenizer.mask
    if getattr(args, "model_running_mode", "vanilla") != "vanilla" and args.mask_token == args.tokenizer.eod:
        source, fix = (("the tokenizer's mask token", "pass --mask-token with another id") if requested_mask is None
                       else ("--mask-token", "pass another id, or drop it and append one with --add-mask-token"))
        raise ValueError(f"{source} {args.mask_token} is the EOD token: masked positions would read as document "
                         f"ends and the sampler could never emit EOD; {fix}")
