"""Generate text with a MegaDLMs model: a checkpoint of ours, or a tiny random model.

    python examples/dlm_generation/dlm_inference.py            # random model + bundled tokenizer, seconds
    python examples/dlm_generation/dlm_inference.py --load ckpts/run1 --tokenizer-model tokenizer.model \\
        --prompt "Fellow-Citizens of the Senate" --max-new-tokens 64 --sample-steps 64 --inference-block-size 32 \\
        [--cache dual --threshold 0.9] [--torch-compile --cuda-graphs]

The checkpoint's metadata.json gives the architecture and the running mode (diffusion or AR);
it loads into one process whatever parallel layout it was saved with, and runs in bf16 on a GPU
(fp32 on CPU). The tokenizer type
comes from the metadata; its files from --tokenizer-model / --vocab-file / --merge-file, else
from the absolute paths the checkpoint records (when they still exist on this machine).

A bad input (a damaged or incomplete checkpoint, an empty or over-long --prompt, text for a
NullTokenizer checkpoint, --max-new-tokens that --inference-block-size does not divide) is one
line `error: ...` on stderr and exit status 1, found before the checkpoint's weights are loaded.
"""

import argparse
import os
import sys
from argparse import Namespace
from typing import List, Optional

import torch

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.errors import InputError
from megatron.core.inference.generation import resolve_options
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.compilation import compile_transformer_layers
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.checkpoint_files import configs_from_metadata, inference_metadata
from megatron.training.checkpointing import load_inference_model
from megatron.training.tokenizer import build_tokenizer

BUNDLED_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "data", "tokenizer", "spm_8k.model")

DEFAULT_BLOCK = 8  # --inference-block-size of the semi-autoregressive sampler


def load_checkpoint_model(root: str, device: torch.device) -> GPTModel:
    """GPTModel in eval mode of the latest checkpoint under `root`."""
    model, metadata = load_inference_model(root, device)
    print(f"loaded {metadata['source']} ({model.running_mode}, {sum(p.numel() for p in model.parameters()):,} "
          "parameters)")
    return model


def random_model(vocab_size: int, mask_token_id: int) -> GPTModel:
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, vocab_size=vocab_size, max_position_embeddings=512,
                               qk_layernorm=True, init_method_std=0.5)
    print("no --load: a random 2-layer model (expect gibberish)")
    return GPTModel(config, DLMConfig(mask_token_id=mask_token_id)).eval()


def recorded_tokenizer_files(identity: dict) -> dict:
    """tokenizer_model / vocab_file / merge_file from the paths the checkpoint's identity records;
    empty when it records none or they are not on this machine."""
    files = identity.get("files") or []
    if not files:
        return {}
    missing = [path for path in files if not os.path.isfile(path)]
    if missing:
        print(f"note: the checkpoint's tokenizer files {missing} are not here; pass --tokenizer-model "
              "(or --vocab-file/--merge-file) to use text prompts")
        return {}
    if identity.get("type") == "GPT2BPETokenizer" and len(files) == 2:
        return {"vocab_file": files[0], "merge_file": files[1]}
    if identity.get("type") == "HuggingFaceTokenizer" and len(files) > 1:
        return {"tokenizer_model": os.path.dirname(files[0])}  # tokenizer.json + configs: the folder
    return {"tokenizer_model": files[0]}


def build_text_tokenizer(args, identity: dict):
    """The tokenizer, or None when prompts are given as ids (NullTokenizer or no tokenizer file)."""
    tokenizer_type = args.tokenizer_type or identity.get("type")
    paths = dict(tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file)
    if not any(paths.values()):
        paths.update(recorded_tokenizer_files(identity) if args.load else {"tokenizer_model": BUNDLED_TOKENIZER})
    if tokenizer_type in (None, "NullTokenizer") and not args.load:
        tokenizer_type = "SentencePieceTokenizer"
    if tokenizer_type in (None, "NullTokenizer") or not (paths["tokenizer_model"] or paths["vocab_file"]):
        return None
    tokenizer = build_tokenizer(Namespace(tokenizer_type=tokenizer_type, **paths))
    if identity.get("sha256") and tokenizer.identity.get("sha256") != identity["sha256"]:
        print("warning: this tokenizer's files differ from the ones the checkpoint was trained with")
    return tokenizer


def prompt_ids(args, tokenizer, identity: dict, vocab: int) -> List[int]:
    """The ids of --prompt: tokenized text, or whitespace-separated ids where there is no tokenizer."""
    shown = args.prompt if len(args.prompt) <= 40 else args.prompt[:37] + "..."
    if not args.prompt.strip():
        raise InputError("--prompt is empty; give the text to continue (or token ids, without a tokenizer)")
    if tokenizer is not None:
        return tokenizer.tokenize(args.prompt)
    try:
        ids = [int(token) for token in args.prompt.split()]
    except ValueError:
        if identity.get("type") in (None, "NullTokenizer"):
            why, fix = "the checkpoint was trained with the NullTokenizer, which has no text", ", e.g. --prompt '1 2 3'"
        else:
            why, fix = f"the checkpoint's {identity['type']} files are not here", ", or pass --tokenizer-model"
        raise InputError(f"--prompt {shown!r} is text but {why}; give whitespace-separated token ids {fix}") from None
    outside = [token for token in ids if not 0 <= token < vocab]
    if outside:
        raise InputError(f"--prompt holds token id {outside[0]}, outside this model's vocabulary [0, {vocab}); "
                         f"give ids below {vocab}")
    return ids


def check_request(args, prompt_length: int, running_mode: str, positions: int, block_diffusion: bool = False) -> None:
    """The length flags against the model, in this tool's flag names, before its weights are loaded.
    A block-diffusion model goes by its own blocks: any --max-new-tokens, no --inference-block-size."""
    new = args.max_new_tokens
    if new < 1:
        raise InputError(f"--max-new-tokens {new} must be at least 1")
    if prompt_length + new > positions:
        raise InputError(f"--prompt ({prompt_length} tokens) plus --max-new-tokens {new} needs "
                         f"{prompt_length + new} positions, more than the model's {positions}; shorten --prompt "
                         "or lower --max-new-tokens")
    if block_diffusion and args.inference_block_size is not None:
        raise InputError("--inference-block-size: a block-diffusion model samples by the blocks it was trained with; "
                         "drop the flag")
    if running_mode == "vanilla" or block_diffusion:
        return
    block = args.inference_block_size = args.inference_block_size or DEFAULT_BLOCK
    if block < 1:
        raise InputError(f"--inference-block-size {block} must be at least 1")
    if new % block:
        raise InputError(f"--max-new-tokens {new} is not a multiple of --inference-block-size {block}; use "
                         f"--max-new-tokens {-(-new // block) * block} or a block size that divides {new}")
    blocks = new // block
    if args.threshold is None and args.sample_steps % blocks:
        raise InputError(f"--sample-steps {args.sample_steps} is not a multiple of the {blocks} blocks "
                         f"(--max-new-tokens / --inference-block-size); use --sample-steps "
                         f"{max(1, args.sample_steps // blocks) * blocks}")


def generation_options(args, running_mode: str, device: torch.device, pattern: Optional[dict] = None) -> dict:
    """The sampler's options; `pattern`: the checkpoint's attention (checked together, before loading)."""
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   generator=torch.Generator(device).manual_seed(args.seed))
    if running_mode != "vanilla":
        options.update(sample_steps=args.sample_steps, inference_block_size=args.inference_block_size, cfg=args.cfg,
                       remasking=args.remasking, threshold=args.threshold, cache=args.cache)
    resolve_options(running_mode, **options, **(pattern or {}))  # the library's checks, before any weight loads
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", help="A --save directory of pretrain_difflm.py; none: a random model.")
    parser.add_argument("--tokenizer-type", help="Default: the checkpoint's.")
    parser.add_argument("--tokenizer-model", help="SentencePiece .model / tokenizer.json (or its folder).")
    parser.add_argument("--vocab-file", help="GPT-2 BPE vocab.json.")
    parser.add_argument("--merge-file", help="GPT-2 BPE merges.txt.")
    parser.add_argument("--prompt", default="Fellow-Citizens of the Senate and House of Representatives:",
                        help="Text, or whitespace-separated token ids without a tokenizer.")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample-steps", type=int, default=32, help="Diffusion steps (DLMs only).")
    parser.add_argument("--inference-block-size", type=int,
                        help=f"Semi-AR block length (DLMs only; default {DEFAULT_BLOCK}; a block-diffusion model uses "
                             "its own).")
    parser.add_argument("--cfg", type=float, default=0.0, help="Classifier-free guidance (DLMs only).")
    parser.add_argument("--remasking", default="low_confidence", choices=["low_confidence", "random"])
    parser.add_argument("--threshold", type=float, help="Fast-dLLM parallel decoding threshold (DLMs only).")
    parser.add_argument("--cache", choices=["prefix", "dual"], help="Fast-dLLM block KV cache (DLMs only).")
    parser.add_argument("--autoregressive", action="store_true",
                        help="Decode a joint AR + DLM checkpoint (--difflm-ar-loss-weight) token by token, causally.")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="Default: cuda when available (bf16 weights), else cpu (fp32).")
    parser.add_argument("--torch-compile", action="store_true",
                        help="torch.compile each transformer layer (the first call compiles; docs/performance.md "
                             "has the speed-ups on an H200).")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="Replay a CUDA graph per forward shape (CUDA only; composes with --torch-compile).")
    return parser


def run(args, device: torch.device) -> None:
    """Check the checkpoint, the tokenizer, the prompt and the options; then load, generate, print."""
    torch.manual_seed(args.seed)
    metadata = inference_metadata(args.load) if args.load else None
    identity = (metadata or {}).get("tokenizer") or {}
    tokenizer = build_text_tokenizer(args, identity)
    model = None
    if metadata is None:  # tiny: built first, its sizes are the limits
        model = random_model(tokenizer.vocab_size if tokenizer else 256, tokenizer.mask if tokenizer else 255)
        model = model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        config, running_mode = model.config, model.running_mode
    else:
        config, dlm = configs_from_metadata(metadata)
        running_mode = dlm.model_running_mode
    bd3 = metadata is not None and dlm.block_diffusion
    joint = args.autoregressive and running_mode != "vanilla"  # a joint AR + DLM model decoding token by token
    if joint and not (metadata is not None and dlm.causal_clean_half):
        raise InputError(f"--autoregressive decodes a vanilla checkpoint or a joint AR + DLM one (trained with "
                         f"--difflm-ar-loss-weight); this one is {running_mode} without it: drop the flag")
    if joint:
        running_mode, bd3 = "vanilla", False
    ids = prompt_ids(args, tokenizer, identity, config.unpadded_vocab_size or config.vocab_size)
    check_request(args, len(ids), running_mode, config.max_position_embeddings, bd3)
    pattern = dict(attention_mask_type="block_diffusion", attention_block_size=dlm.block_size) if bd3 else None
    options = generation_options(args, running_mode, device, pattern)
    if model is None:
        model = load_checkpoint_model(args.load, device)
    if args.torch_compile:  # dynamic shapes: the canvas, block and cache offsets change between forwards
        compile_transformer_layers(model, dynamic=True)
    output = model.generate(torch.tensor([ids], device=device), cuda_graphs=args.cuda_graphs, autoregressive=joint,
                            eos_token_id=tokenizer.eod if tokenizer else identity.get("eod"),
                            **options)[0, len(ids):].tolist()
    print(f"prompt:    {args.prompt}")
    print(f"generated: {tokenizer.detokenize(output) if tokenizer else output}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graphs and device.type != "cuda":
        parser.error("--cuda-graphs needs a CUDA device; drop it on CPU")
    try:
        run(args, device)
    except (ValueError, OSError) as error:  # InputError, the library's option checks, unreadable files
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
