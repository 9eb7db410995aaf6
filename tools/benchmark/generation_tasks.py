"""Chat prompts for generation_throughput.py `--prompt chat`: SFT records whose answers end at EOS.

The records are those `tools/preprocess_data.py --chat` trains on (prompt/response or messages;
tools/build_verse_task.py writes some), encoded exactly as training encodes them
(`chat_template.ChatEncoder`): the prompt is everything before the answer flags, with the chat
template's generation prompt, and the reference answer is the flagged tail, ending in EOS.

A batch holds prompts of one token length (no padding: every row's canvas starts at the same
position, as the throughput rows assume): the length that most records share, its first
`batch_size` records in file order.

Per row of a decoding variant: the answer is the generated text up to and including its first
EOS (all of it when there is none); `eos_rate` is the fraction of rows that stop, `exact_match`
the fraction whose answer equals the reference's, and `answer_tokens` their mean length.
"""

from __future__ import annotations

import collections
import gzip
import json
import zlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.training.tokenizer import chat_template

Example = Tuple[List[int], List[int]]


class TaskError(ValueError):
    """A prompt file that gives no usable batch (one line for the user)."""


def chat_examples(tokenizer, path: str, template: str = "auto") -> List[Example]:
    """(prompt ids, reference answer ids) of every record of a JSONL(.gz) file."""
    try:
        encoder = chat_template.ChatEncoder(tokenizer, chat_template.resolve_template(template, tokenizer)[0])
    except ValueError as error:
        raise TaskError(str(error)) from None
    examples = []
    for number, record in records(path):
        try:
            [(ids, flags)] = encoder.encode_record(record, number)[:1]
        except (ValueError, chat_template.ChatError) as error:
            raise TaskError(f"--prompt-file {path} line {number}: {error}; give chat records "
                            "(prompt/response or messages)") from None
        start = flags.index(1)
        examples.append((ids[:start], ids[start:]))
    return examples


def records(path: str) -> Iterator[Tuple[int, dict]]:
    """(line number, JSON object) of every non-blank line of a JSONL(.gz) file; TaskError (one line
    naming the file and the fix) on text that is not UTF-8, broken gzip data or a line that is not JSON."""
    number = 0
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, json.loads(line)
    except json.JSONDecodeError as error:
        raise TaskError(f"--prompt-file {path} line {number}: not JSON ({error.msg}); give one JSON object "
                        "a line") from None
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise TaskError(f"--prompt-file {path}: unreadable after line {number} ({type(error).__name__}); "
                        "give UTF-8 JSONL, or re-compress the .gz") from None


def equal_length_batch(examples: Sequence[Example], batch_size: int, path: str) -> Tuple[torch.Tensor, List[List[int]]]:
    """[batch, P] prompts of the most common prompt length P (the shortest among ties) and their answers."""
    counts = collections.Counter(len(prompt) for prompt, _ in examples)
    if not counts:
        raise TaskError(f"--prompt-file {path} holds no records")
    length = min(counts, key=lambda n: (-counts[n], n))
    if counts[length] < batch_size:
        raise TaskError(f"--prompt-file {path}: at most {counts[length]} prompts share a token length "
                        f"({length}); lower --batch-sizes to {counts[length]} or give more records")
    chosen = [example for example in examples if len(example[0]) == length][:batch_size]
    return torch.tensor([prompt for prompt, _ in chosen]), [answer for _, answer in chosen]


def answer_of(row: Sequence[int], eos: int) -> List[int]:
    """The tokens up to and including the first EOS (all of them without one)."""
    row = list(row)
    return row[:row.index(eos) + 1] if eos in row else row


def answer_figures(generated: torch.Tensor, references: Sequence[Sequence[int]], eos: int) -> dict:
    """eos_rate, exact_match and the mean answer length of [batch, G] generated rows."""
    answers = [answer_of(row, eos) for row in generated.tolist()]
    stopped = [answer[-1:] == [eos] for answer in answers]
    references = [reference.tolist() if torch.is_tensor(reference) else list(reference) for reference in references]
    same = [answer == answer_of(reference, eos) for answer, reference in zip(answers, references)]
    return {"eos_rate": sum(stopped) / len(answers), "exact_match": sum(same) / len(answers),
            "answer_tokens": sum(map(len, answers)) / len(answers), "answers": answers}


def first_eos_cut(rows: torch.Tensor, eos: Optional[int]) -> List[torch.Tensor]:
    """Each row up to its first EOS (included), as the judge should score it; whole rows without EOS."""
    if eos is None:
        return list(rows)
    return [row[:len(answer_of(row.tolist(), eos))] for row in rows]
