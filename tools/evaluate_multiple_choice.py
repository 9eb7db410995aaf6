"""Multiple-choice evaluation of a checkpoint of ours by answer log-likelihood (LLaDA's method).

    python tools/evaluate_multiple_choice.py --load CKPT_DIR --data tasks.jsonl \
        [--mc-num 128 --batch-size 32 --cfg 0.0] [--tokenizer-model FILE] [--limit N] [--json OUT]

Each line of `--data` is one question in lm-eval-harness's multiple-choice shape:
``{"context": "...", "choices": ["...", ...], "label": 0}`` (optional ``"delimiter"``, default
" ", put between the context and each choice). Every choice is scored by
`GPTModel.log_likelihood` (megatron.core.inference.likelihood: the Monte Carlo ELBO of the
choice given the context for diffusion models, with `--mc-num` samples; exact for AR models),
the prediction is the best-scoring choice, and the report gives `acc` and `acc_norm` (scores
divided by each choice's length in UTF-8 bytes, as lm-eval normalises) with their standard
errors. The choice's tokens are those of context + delimiter + choice after the context's own,
as lm-eval splits them, so a merge across the boundary does not change the context.
`examples/data/multiple_choice_sample.jsonl` is a small task in that format.

Bad input (flags, the question file, a damaged or incomplete checkpoint, a NullTokenizer
checkpoint, a `--json` path that cannot be written) is one line `error: ...` and exit status 2,
found before the model is loaded. The `--json` report is written to a temporary file beside it
and renamed into place, so an earlier report is replaced whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.checkpoint_files import inference_metadata  # noqa: E402
from megatron.training.checkpointing import load_inference_model  # noqa: E402

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data",
                      "multiple_choice_sample.jsonl")


class UsageError(ValueError):
    pass


def read_questions(path: str, limit: Optional[int]) -> List[dict]:
    """The questions of a jsonl file, each checked: one error naming the line and the field."""
    questions = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}:{number}: not JSON ({error.msg})") from None
            choices, label = record.get("choices"), record.get("label")
            if not isinstance(record.get("context"), str):
                raise UsageError(f"{path}:{number}: 'context' must be a string")
            if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
                raise UsageError(f"{path}:{number}: 'choices' must be a list of at least two non-empty strings")
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
                raise UsageError(f"{path}:{number}: 'label' must be the index of the right choice, "
                                 f"in [0, {len(choices)})")
            questions.append(record)
            if limit is not None and len(questions) == limit:
                break
    if not questions:
        raise UsageError(f"{path} holds no questions")
    return questions


def split_tokens(tokenizer, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """(context ids, continuation ids): the whole text's ids after the context's own ids."""
    whole, head = tokenizer.tokenize(context + continuation), tokenizer.tokenize(context)
    if whole[:len(head)] == head and len(whole) > len(head):
        return head, whole[len(head):]
    return head, tokenizer.tokenize(continuation)


def evaluate(model, tokenizer, questions: List[dict], args: argparse.Namespace, device: torch.device) -> dict:
    options = dict(mc_num=args.mc_num, batch_size=args.batch_size, cfg_scale=args.cfg)
    items = []
    for index, question in enumerate(questions):
        delimiter = question.get("delimiter", " ")
        scores = []
        for choice in question["choices"]:
            context, answer = split_tokens(tokenizer, question["context"], delimiter + choice)
            generator = torch.Generator().manual_seed(args.seed + index)  # every choice sees the same draws
            context_ids, answer_ids = torch.tensor(context, device=device), torch.tensor(answer, device=device)
            scores.append(model.log_likelihood(context_ids, answer_ids, generator=generator, **options))
        normalised = [score / len(choice.encode()) for score, choice in zip(scores, question["choices"])]
        items.append({"label": question["label"], "scores": scores,
                      "prediction": max(range(len(scores)), key=scores.__getitem__),
                      "prediction_norm": max(range(len(scores)), key=normalised.__getitem__)})
    report = {"questions": len(items)}
    for metric, key in (("acc", "prediction"), ("acc_norm", "prediction_norm")):
        hits = [item[key] == item["label"] for item in items]
        mean = sum(hits) / len(hits)
        report[metric] = mean
        report[f"{metric}_stderr"] = math.sqrt(mean * (1 - mean) / (len(hits) - 1)) if len(hits) > 1 else None
    report["items"] = items
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="A --save directory of pretrain_difflm.py.")
    parser.add_argument("--data", default=SAMPLE, help="Questions, one JSON object a line (default: the bundled "
                        "sample).")
    parser.add_argument("--tokenizer-model", help="The training tokenizer's file (default: the files the "
                        "checkpoint records).")
    parser.add_argument("--mc-num", type=int, default=128, help="Monte Carlo samples per choice (DLMs).")
    parser.add_argument("--batch-size", type=int, default=32, help="Samples per forward (DLMs).")
    parser.add_argument("--cfg", type=float, default=0.0, help="Classifier-free guidance scale (DLMs).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, help="Only the first N questions.")
    parser.add_argument("--device", help="Default: cuda when available (bf16 weights), else cpu (fp32).")
    parser.add_argument("--json", help="Write the report (every choice's score) here.")
    return parser


def check_writable(path: str) -> None:
    """Fail now, not after the evaluation, when --json cannot be written: make and remove a file beside it."""
    if os.path.isdir(path):
        raise UsageError(f"--json {path} is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".json-probe-")
    except OSError as error:
        raise UsageError(f"--json {path} cannot be written ({error.strerror}: {folder}); choose a path in an "
                         "existing, writable folder") from None
    os.close(handle)
    os.remove(probe)


def write_report(path: str, report: dict) -> None:
    """Temporary file beside `path`, then os.replace: a reader sees the old report or the new one, whole."""
    temporary = f"{path}.tmp-{os.getpid()}"  # opened as usual (not mkstemp's 0600): the report keeps umask modes
    try:
        with open(temporary, "w") as stream:
            json.dump(report, stream, indent=1)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def prepare(args: argparse.Namespace, device: torch.device):
    """(questions, model, metadata, tokenizer), every input checked before the model is loaded."""
    from megatron.training.tokenizer.identity import rebuild_training_tokenizer

    if args.mc_num < 1 or args.batch_size < 1 or args.mc_num % args.batch_size:
        raise UsageError(f"--mc-num {args.mc_num} must be a positive multiple of --batch-size {args.batch_size}")
    if args.json:
        check_writable(args.json)
    questions = read_questions(args.data, args.limit)
    metadata = inference_metadata(args.load)
    identity = metadata.get("tokenizer") or {"type": "NullTokenizer"}  # none recorded: as the exporter reads it
    tokenizer = rebuild_training_tokenizer(identity, tokenizer_model=args.tokenizer_model)
    if tokenizer is None:
        raise UsageError(f"--load {args.load} was trained with the NullTokenizer: there is no text to score; "
                         "evaluate a checkpoint trained with a text tokenizer")
    model, metadata = load_inference_model(args.load, device)
    return questions, model, metadata, tokenizer


def main(argv: Optional[List[str]] = None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        questions, model, metadata, tokenizer = prepare(args, device)
    except (UsageError, ValueError, OSError) as error:  # InputError and TokenizerIdentityError are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    report = evaluate(model, tokenizer, questions, args, device)
    report.update(checkpoint=metadata["source"], running_mode=model.running_mode, data=args.data,
                  mc_num=args.mc_num if model.running_mode != "vanilla" else None, cfg=args.cfg)
    stderr = report["acc_stderr"]
    print(f"{report['questions']} questions, {model.running_mode}: acc {report['acc']:.4f}"
          + (f" ± {stderr:.4f}" if stderr is not None else "") + f", acc_norm {report['acc_norm']:.4f}")
    if args.json:
        try:
            write_report(args.json, report)
        except OSError as error:  # the folder went away during the evaluation
            print(f"error: --json {args.json} could not be written ({error}); the accuracy is above", file=sys.stderr)
            sys.exit(2)
    return report


if __name__ == "__main__":
    main()
