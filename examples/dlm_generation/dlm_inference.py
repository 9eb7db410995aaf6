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
"""

import argparse
import os
import sys
from argparse import Namespace

import torch

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.compilation import compile_transformer_layers
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.checkpointing import load_inference_model
from megatron.training.tokenizer import build_tokenizer

BUNDLED_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "data", "tokenizer", "spm_8k.model")


def load_checkpoint_model(root: str, device: torch.device):
    """(GPTModel in eval mode, tokenizer identity) of the latest checkpoint under `root`."""
    try:
        model, metadata = load_inference_model(root, device)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    print(f"loaded {metadata['source']} ({model.running_mode}, {sum(p.numel() for p in model.parameters()):,} "
          "parameters)")
    return model, metadata.get("tokenizer") or {}


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


def main() -> None:
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
    parser.add_argument("--inference-block-size", type=int, default=8, help="Semi-AR block length (DLMs only).")
    parser.add_argument("--cfg", type=float, default=0.0, help="Classifier-free guidance (DLMs only).")
    parser.add_argument("--remasking", default="low_confidence", choices=["low_confidence", "random"])
    parser.add_argument("--threshold", type=float, help="Fast-dLLM parallel decoding threshold (DLMs only).")
    parser.add_argument("--cache", choices=["prefix", "dual"], help="Fast-dLLM block KV cache (DLMs only).")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="Default: cuda when available (bf16 weights), else cpu (fp32).")
    parser.add_argument("--torch-compile", action="store_true",
                        help="torch.compile each transformer layer (the first call compiles; docs/performance.md "
                             "has the speed-ups on an H200).")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="Replay a CUDA graph per forward shape (CUDA only; composes with --torch-compile).")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graphs and device.type != "cuda":
        parser.error("--cuda-graphs needs a CUDA device; drop it on CPU")

    torch.manual_seed(args.seed)
    model, identity = load_checkpoint_model(args.load, device) if args.load else (None, {})
    tokenizer = build_text_tokenizer(args, identity)
    if model is None:
        model = random_model(tokenizer.vocab_size if tokenizer else 256, tokenizer.mask if tokenizer else 255)
        model = model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.torch_compile:  # dynamic shapes: the canvas, block and cache offsets change between forwards
        compile_transformer_layers(model, dynamic=True)
    ids = tokenizer.tokenize(args.prompt) if tokenizer else [int(token) for token in args.prompt.split()]
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   eos_token_id=tokenizer.eod if tokenizer else identity.get("eod"),
                   generator=torch.Generator(device).manual_seed(args.seed))
    if model.running_mode != "vanilla":
        options.update(sample_steps=args.sample_steps, inference_block_size=args.inference_block_size, cfg=args.cfg,
                       remasking=args.remasking, threshold=args.threshold, cache=args.cache)
    output = model.generate(torch.tensor([ids], device=device), cuda_graphs=args.cuda_graphs,
                            **options)[0, len(ids):].tolist()
    print(f"prompt:    {args.prompt}")
    print(f"generated: {tokenizer.detokenize(output) if tokenizer else output}")


if __name__ == "__main__":
    main()
