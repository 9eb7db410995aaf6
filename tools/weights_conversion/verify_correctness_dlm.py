"""Check a Hugging Face export against its MegaDLMs checkpoint: same text, same logits, same loss.

    python tools/weights_conversion/verify_correctness_dlm.py --load CKPT_DIR --hf-path HF_DIR \
        [--text "..." | --text-file FILE] [--tolerance 1e-4]

Both models run in fp32. Real text (default: the first address of the bundled corpus,
examples/data/) is tokenized with the checkpoint's tokenizer (its sha256 is checked) and cut
into --batch-size rows of --seq-length tokens (default 128, or longer where the model needs it to
be checked: past the original context of RoPE scaling, llama3 / yarn, and past a sliding window,
up to max_position_embeddings; an explicit shorter --seq-length is kept, with a note). In the
difflm-* modes the rows are corrupted with the checkpoint's diffusion process (seeded, the same
for both) and both sides are scored with the training loss (mask weights, normalizer, shift
alignment); in vanilla with the next-token loss. Prints the max and mean absolute logit
difference and the loss difference; exits 1 when either exceeds --tolerance (a bf16 export
needs about 1e-1: its weights are rounded).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.models.difflm import objective  # noqa: E402
from tools.weights_conversion import checkpoint_io  # noqa: E402
from tools.weights_conversion.safetensors_io import LazyWeights, read_config  # noqa: E402
from megatron.training.tokenizer.identity import TokenizerIdentityError, rebuild_training_tokenizer  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_CORPUS = os.path.join(REPO_ROOT, "examples", "data", "sotu_1790_1928.jsonl.gz")


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="MegaDLMs checkpoint directory (or an iter_ folder).")
    parser.add_argument("--iteration", type=int, help="Iteration (default: the latest).")
    parser.add_argument("--hf-path", required=True, help="The Hugging Face export of that checkpoint.")
    parser.add_argument("--text", help="Text to run (default: the bundled corpus).")
    parser.add_argument("--text-file", help="File whose text to run.")
    parser.add_argument("--tokenizer-model", help="Training tokenizer file, when the checkpoint does not "
                        "record it (default: the copy in --hf-path).")
    parser.add_argument("--seq-length", type=int, help="Tokens per row (default 128, or past the original context "
                        "of RoPE scaling / past the sliding window; capped by the model).")
    parser.add_argument("--batch-size", type=int, default=2, help="Rows.")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="Largest accepted absolute difference.")
    return parser.parse_args(argv)


def _text(args) -> str:
    if args.text:
        return args.text
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as handle:
            return handle.read()
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as handle:
        return json.loads(handle.readline())["text"]


def _training_tokenizer(identity: dict, args):
    """The checkpoint's tokenizer from --tokenizer-model, the identity's files or the export's copy."""
    attempts = [dict(tokenizer_model=args.tokenizer_model)] if args.tokenizer_model else []
    attempts.append({})
    kind = identity.get("type")
    if kind == "SentencePieceTokenizer":
        attempts.append(dict(tokenizer_model=os.path.join(args.hf_path, "tokenizer.model")))
    elif kind == "GPT2BPETokenizer":
        attempts.append(dict(vocab_file=os.path.join(args.hf_path, "vocab.json"),
                             merge_file=os.path.join(args.hf_path, "merges.txt")))
    errors = []
    for paths in attempts:
        try:
            return rebuild_training_tokenizer(identity, **paths), None
        except (TokenizerIdentityError, ValueError, FileNotFoundError) as error:
            errors.append(str(error))
    return None, errors[-1]


def exercised_length(config, dlm) -> Optional[Tuple[int, str]]:
    """The shortest length whose positions reach what RoPE scaling or a sliding window changes, and what."""
    needs = []
    if config.rope_scaling_type == "llama3":
        original = config.rope_scaling_original_max_position_embeddings
        needs.append((original + 1, f"llama3 RoPE scaling past original_max_position_embeddings={original}"))
    if config.rope_scaling_type == "yarn":
        original = config.yarn_original_max_position_embeddings
        needs.append((original + 1, f"YaRN past original_max_position_embeddings={original}"))
    if dlm.effective_mask_type in ("sliding_window", "sliding_window_two_sided"):
        needs.append((config.sliding_window + 1, f"the sliding window of {config.sliding_window} tokens"))
    return max(needs) if needs else None


def choose_length(args, config, dlm) -> int:
    """--seq-length, or the default raised to what `exercised_length` asks, capped by the model."""
    need, limit = exercised_length(config, dlm), config.max_position_embeddings
    length = args.seq_length or max(128, need[0] if need else 0)
    if need and min(length, limit) < need[0]:
        why = "the model's max_position_embeddings" if length >= need[0] else "--seq-length"
        print(f"> note: {min(length, limit)} tokens (capped by {why}) do not reach {need[1]}: that part is "
              "not checked")
    return min(length, limit)


def token_rows(args, metadata: dict, vocab: int, length: int) -> torch.Tensor:
    """[batch, length] ids of real text (or, for the NullTokenizer, of a fixed random draw)."""
    needed = length * args.batch_size
    identity = metadata.get("tokenizer") or {"type": "NullTokenizer"}
    tokenizer, problem = _training_tokenizer(identity, args)
    if tokenizer is not None:
        ids = tokenizer.tokenize(_text(args))
        source = f"{tokenizer.type_name} ({len(ids)} tokens)"
    elif identity.get("type") == "NullTokenizer":
        ids = torch.randint(0, vocab, (needed,), generator=torch.Generator().manual_seed(0)).tolist()
        source = "random ids (the checkpoint was trained with the NullTokenizer: there is no text)"
    else:
        raise TokenizerIdentityError(f"cannot rebuild the checkpoint's tokenizer: {problem}")
    if len(ids) < needed:
        ids = (ids * (needed // max(len(ids), 1) + 1))[:needed]
    print(f"> input: {args.batch_size} x {length} tokens from {source}")
    return torch.tensor(ids[:needed], dtype=torch.long).view(args.batch_size, length)


def mode_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, normalizer: torch.Tensor,
              shift: bool) -> torch.Tensor:
    """The training loss of the running mode from full-vocabulary logits (what OutputLayer.loss computes)."""
    if shift:
        logits, targets = logits[:, :-1], labels[:, 1:]
    else:
        targets = labels
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    ce = ce.view(targets.shape)
    per_token = F.pad(ce, (1, 0)) if shift else ce
    weights = weights.clone()
    if shift:
        weights[:, 0] = 0.0
    return (per_token * weights).sum() / normalizer


@torch.no_grad()
def compare(model, hf_model, ids: torch.Tensor) -> dict:
    dlm = model.dlm_config
    vocab = model.config.unpadded_vocab_size
    # Both sides see the batch compute_loss makes (objective.py): the same corruption, weights,
    # normalizer and, in vanilla, the same next-token labels.
    key = objective.default_corruption_key(ids, dlm) if dlm.is_diffusion else None
    labels, loss_mask = (ids, None) if dlm.is_diffusion else objective.next_token_labels(ids)
    inputs, weights, normalizer, _ = objective.loss_inputs(ids, dlm, key, loss_mask, clamp_normalizer=True)
    ours = model.compute_loss(ids, key)
    shift = dlm.model_running_mode == "difflm-shift"
    our_logits = model(inputs)[..., :vocab].float()
    hf_logits = hf_model(inputs).logits.float()
    if hf_logits.shape != our_logits.shape:
        raise ValueError(f"logit shapes differ: checkpoint {tuple(our_logits.shape)}, export "
                         f"{tuple(hf_logits.shape)}; is --hf-path the export of --load?")
    hf_loss = mode_loss(hf_logits, labels, weights, normalizer, shift)
    difference = (our_logits - hf_logits).abs()
    return {"max_abs": difference.max().item(), "mean_abs": difference.mean().item(),
            "loss": ours.loss.item(), "hf_loss": hf_loss.item(),
            "loss_diff": abs(ours.loss.item() - hf_loss.item()), "mode": dlm.model_running_mode}


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        from transformers import AutoModelForCausalLM

        read_config(args.hf_path)  # the export checked before any model is built (load_model checks --load)
        LazyWeights(args.hf_path)
        model, metadata, iter_dir = checkpoint_io.load_model(args.load, args.iteration)
        hf_model = AutoModelForCausalLM.from_pretrained(args.hf_path, trust_remote_code=True,
                                                        dtype=torch.float32).eval()
        length = choose_length(args, model.config, model.dlm_config)
        ids = token_rows(args, metadata, model.config.unpadded_vocab_size, length)
        result = compare(model, hf_model, ids)
    except (ValueError, OSError) as error:  # InputError and TokenizerIdentityError are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"> {iter_dir} vs {args.hf_path} ({result['mode']}, fp32)")
    print(f"  logits: max abs diff {result['max_abs']:.3e}, mean abs diff {result['mean_abs']:.3e}")
    print(f"  loss: checkpoint {result['loss']:.6f}, export {result['hf_loss']:.6f}, "
          f"abs diff {result['loss_diff']:.3e}")
    worst = max(result["max_abs"], result["loss_diff"])
    if worst > args.tolerance:
        print(f"FAILED: difference {worst:.3e} exceeds the tolerance {args.tolerance:.1e}")
        return 1
    print(f"OK: within the tolerance {args.tolerance:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
