#!/usr/bin/env python3
"""Write a file of generated RL tasks with verifiable rewards (megatron/rl/tasks.py).

    python tools/build_rl_task.py --kind countdown --count 1000 --seed 1 --output data/rl/countdown.jsonl.gz

--kind countdown: reach a target with 3 or 4 numbers and + - * /; sudoku: solve a 4x4 Sudoku;
arithmetic: add or multiply two 3- to 5-digit integers. The same --seed gives the same tasks, byte
for byte. An existing --output is kept unless --force is given; bad input is one line
`build_rl_task.py: error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.errors import InputError  # noqa: E402
from megatron.rl import tasks  # noqa: E402

PROG = "build_rl_task.py"


def fail(message: str) -> int:
    """Prints the one-line error and returns the exit status for bad input."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def get_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """The parsed flags."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", required=True, choices=tasks.GENERATOR_KINDS, help="which tasks to generate")
    parser.add_argument("--count", required=True, type=int, help="how many tasks")
    parser.add_argument("--seed", required=True, type=int, help="the same seed gives the same tasks")
    parser.add_argument("--output", required=True, help="the task file to write: FILE.jsonl or FILE.jsonl.gz")
    parser.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    parser.add_argument("--reward", help="the tasks' reward kind where the kind offers several: sudoku (1.0 for "
                                         "a solution, the default) or sudoku_cells (d1's partial credit: the "
                                         "share of the blanks filled right)")
    parser.add_argument("--sft", action="store_true",
                        help="write chat records (prompt/response: the answer in its tags) for supervised "
                             "fine-tuning (tools/preprocess_data.py --chat) instead of task records")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Generates and writes the tasks; returns the exit status."""
    args = get_args(argv)
    if args.count < 1:
        return fail(f"--count {args.count}: give at least 1")
    if not args.output.endswith((".jsonl", ".jsonl.gz")):
        return fail(f"--output {args.output}: not a .jsonl or .jsonl.gz name; give one")
    if os.path.lexists(args.output) and not args.force:
        return fail(f"--output {args.output} exists; pass --force to overwrite it, or give another path")
    try:
        records = tasks.generate_tasks(args.kind, args.count, args.seed, args.reward)
        written = (tasks.write_json_lines(map(tasks.sft_record, records), args.output) if args.sft
                   else tasks.write_tasks(records, args.output))
    except (InputError, OSError) as error:
        return fail(f"--output {args.output}: {error}" if isinstance(error, OSError) else str(error))
    reward = f", reward {args.reward}" if args.reward else ""
    print(f"wrote {args.output}: {written} {args.kind} tasks (seed {args.seed}{reward})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
