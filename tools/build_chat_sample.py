"""Write the bundled SFT sample: examples/data/chat_sample.jsonl and chat_sample_heldout.jsonl.

    python tools/build_chat_sample.py            # the committed files, byte for byte

Conversations of simple templated tasks with one right answer each (repeat or reverse a short word
list, add two small numbers, the capital of a country from a fixed table, yes/no comparisons, counting
words), so that a tiny model learns them in about a hundred SFT steps and a held-out split shows it.
Some conversations open with a system turn (one of them asks for the shortest answer, which changes
the answer: a learnable use of the system prompt); about a fifth have two or three user turns, some
of which refer back to the previous turn ("Now reverse my list."). Everything comes from one seeded
random.Random, so the output depends only on the flags; the held-out split uses another seed and
leaves out every conversation that the training split has.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List, Optional, Tuple

WORDS = ("apple", "bird", "boat", "book", "bread", "car", "cat", "chair", "cloud", "cup", "dog", "door",
         "egg", "fish", "flower", "hat", "horse", "house", "key", "lamp", "leaf", "moon", "mouse", "pen",
         "rain", "river", "road", "rock", "shoe", "star", "sun", "table", "tree", "water", "wind", "window")
CAPITALS = {"France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Japan": "Tokyo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
            "Greece": "Athens", "Russia": "Moscow", "China": "Beijing", "India": "New Delhi",
            "Poland": "Warsaw", "Austria": "Vienna", "Portugal": "Lisbon", "Ireland": "Dublin",
            "Sweden": "Stockholm", "Finland": "Helsinki", "Cuba": "Havana", "Chile": "Santiago",
            "Mexico": "Mexico City", "Turkey": "Ankara"}
SHORT_SYSTEM = "Answer in as few words as possible."
SYSTEMS = ("You are a helpful assistant.", "You are a careful assistant. Check your answer before you give it.",
           SHORT_SYSTEM)
Turn = Tuple[str, str, str]  # (question, full answer, shortest answer)


def _word_list(rng: random.Random) -> List[str]:
    return rng.sample(WORDS, rng.randint(2, 5))


def _repeat(rng: random.Random, words: List[str]) -> Turn:
    text = " ".join(words)
    question = rng.choice(("Repeat these words: {}", "Say these words again: {}", "Copy this list: {}"))
    return question.format(text), text, text


def _reverse(rng: random.Random, words: List[str]) -> Turn:
    text = " ".join(reversed(words))
    question = rng.choice(("Reverse these words: {}", "Say these words in reverse order: {}"))
    return question.format(" ".join(words)), text, text


def _count(rng: random.Random, words: List[str]) -> Turn:
    question = rng.choice(("How many words are in this list: {}?", "Count the words: {}"))
    return question.format(" ".join(words)), f"There are {len(words)} words.", str(len(words))


def _add(rng: random.Random) -> Turn:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    question = rng.choice(("What is {} plus {}?", "Add {} and {}.", "Compute {} + {}."))
    return question.format(a, b), f"{a} plus {b} is {a + b}.", str(a + b)


def _capital(rng: random.Random) -> Turn:
    country = rng.choice(sorted(CAPITALS))
    question = rng.choice(("What is the capital of {}?", "Which city is the capital of {}?", "Name the capital of {}."))
    city = CAPITALS[country]
    return question.format(country), f"The capital of {country} is {city}.", city


def _compare(rng: random.Random) -> Turn:
    a, b = rng.sample(range(20), 2)
    if rng.random() < 0.5:
        word = "Yes" if a > b else "No"
        return f"Is {a} greater than {b}?", f"{word}, {a} is {'greater' if a > b else 'less'} than {b}.", word
    word = "Yes" if a % 2 == 0 else "No"
    return f"Is {a} an even number?", f"{word}, {a} is {'even' if a % 2 == 0 else 'odd'}.", word


def _task(rng: random.Random) -> Tuple[Turn, Optional[List[str]]]:
    """One independent question, and its word list when a follow-up can refer back to it."""
    kind = rng.choice(("repeat", "reverse", "count", "add", "capital", "compare"))
    if kind in ("repeat", "reverse", "count"):
        words = _word_list(rng)
        return {"repeat": _repeat, "reverse": _reverse, "count": _count}[kind](rng, words), words
    return {"add": _add, "capital": _capital, "compare": _compare}[kind](rng), None


def _follow_up(rng: random.Random, words: List[str]) -> Turn:
    """A turn about the previous turn's words: it is only answerable with the history."""
    which = rng.choice(("reverse", "count", "first"))
    if which == "reverse":
        text = " ".join(reversed(words))
        return "Now reverse my list.", text, text
    if which == "count":
        return "How many words were in my list?", f"Your list had {len(words)} words.", str(len(words))
    return "Which word came first in my list?", f"The first word was {words[0]}.", words[0]


def conversation(rng: random.Random) -> Dict[str, list]:
    messages = []
    system = rng.choice(SYSTEMS) if rng.random() < 0.3 else None
    if system is not None:
        messages.append({"role": "system", "content": system})
    turns = 1 if rng.random() < 0.8 else rng.randint(2, 3)
    words = None
    for _ in range(turns):
        if words is not None and rng.random() < 0.5:
            turn, words = _follow_up(rng, words), None
        else:
            turn, words = _task(rng)
        question, full, short = turn
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": short if system == SHORT_SYSTEM else full}]
    return {"messages": messages}


def build(count: int, seed: int, exclude: frozenset = frozenset()) -> List[str]:
    """`count` distinct JSON lines from `seed`, none of them in `exclude`."""
    rng, lines, seen = random.Random(seed), [], set(exclude)
    while len(lines) < count:
        line = json.dumps(conversation(rng), ensure_ascii=False)
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return lines


def write_lines(path: str, lines: List[str]) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    os.replace(temporary, path)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="examples/data/chat_sample.jsonl")
    parser.add_argument("--heldout-output", default="examples/data/chat_sample_heldout.jsonl")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--heldout-count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--heldout-seed", type=int, default=2)
    args = parser.parse_args(argv)
    train = build(args.count, args.seed)
    heldout = build(args.heldout_count, args.heldout_seed, exclude=frozenset(train))
    write_lines(args.output, train)
    write_lines(args.heldout_output, heldout)
    print(f"wrote {args.output} ({len(train)} conversations), {args.heldout_output} ({len(heldout)})")


if __name__ == "__main__":
    main()
