"""Megatron-LM's and MegaDLMs' further checkpoint flags: non-persistent checkpoints, the step to
load, extra save steps, what a save leaves out, and the formats a launch script may name.

Only torch_dist checkpoints (ours: sharded DCP with a metadata.json, loadable under any layout)
are written and read. A script asking for another format, or for Megatron's in-run conversion,
stops at parse time with one line saying what to use instead.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Collection, Optional, Tuple

# Megatron-LM's --ckpt-format values, old and new; only the first is written here.
CKPT_FORMATS = ("torch_dist", "torch", "torch_dcp", "zarr", "fsdp_dtensor")
NON_PERSISTENT_TYPES = ("global", "local", "in_memory")
CONVERSION_TOOLS = ("tools/weights_conversion (megatron_to_hf.py exports any of our checkpoints to Hugging Face; "
                    "hf_to_megatron.py imports one)")


_SAVE, _LOAD = ("--save DIR", lambda a: bool(a.save)), ("--load DIR", lambda a: bool(a.load))
# arguments.FLAG_NEEDS rules: (dest, what it needs, the test).
CHECKPOINT_FLAG_NEEDS = (
    ("non_persistent_save_interval", "--non-persistent-ckpt-type global or local",
     lambda a: a.non_persistent_ckpt_type is not None),
    ("non_persistent_save_interval", *_SAVE),
    ("non_persistent_ckpt_type", "--non-persistent-save-interval (saving) or --load DIR (loading)",
     lambda a: bool(a.non_persistent_save_interval or a.load)),
    ("non_persistent_global_ckpt_dir", "--non-persistent-ckpt-type global",
     lambda a: a.non_persistent_ckpt_type == "global"),
    ("non_persistent_local_ckpt_dir", "--non-persistent-ckpt-type local",
     lambda a: a.non_persistent_ckpt_type == "local"),
    ("ckpt_step", *_LOAD), ("exit_on_missing_checkpoint", *_LOAD),
    ("checkpoint_steps", *_SAVE), ("no_save_rng", *_SAVE), ("ckpt_fully_parallel_save", *_SAVE),
    ("ckpt_assume_constant_structure", *_SAVE),
)


def add_checkpoint_flags(g: argparse._ArgumentGroup) -> None:
    """Added to the checkpointing group of arguments.py."""
    g.add_argument("--non-persistent-save-interval", type=int,
                   help="Also save a cheap non-persistent checkpoint every N iterations (not at iterations a "
                        "persistent save covers). Only the newest one is kept; --keep-last-checkpoints never "
                        "counts it. --load takes whichever of the persistent and non-persistent checkpoints has "
                        "the higher iteration (the persistent one on a tie).")
    g.add_argument("--non-persistent-ckpt-type", choices=NON_PERSISTENT_TYPES,
                   help="global: a normal sharded checkpoint in --non-persistent-global-ckpt-dir. local: every "
                        "rank writes its own shards into --non-persistent-local-ckpt-dir (node-local storage); "
                        "loadable only under the same layout (world size, TP, PP, CP, EP, DP). in_memory is refused.")
    g.add_argument("--non-persistent-global-ckpt-dir",
                   help="Directory of the global non-persistent checkpoints (default: <--save>/non_persistent "
                        "when saving, <--load>/non_persistent when loading).")
    g.add_argument("--non-persistent-local-ckpt-dir",
                   help="Node-local directory of the local non-persistent checkpoints: rank R writes "
                        "DIR/rank_R/iter_N/ (its boxes, RNG and metadata), synchronously.")
    g.add_argument("--ckpt-step", type=int,
                   help="Load this iteration instead of the tracker's (from --load, or from the non-persistent "
                        "directory if only that holds it).")
    g.add_argument("--checkpoint-steps",
                   help="Comma-separated iterations to save at besides --save-interval, e.g. '1000,5000'.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="With --load: exit with an error when it holds no checkpoint, instead of starting "
                        "from scratch.")
    g.add_argument("--no-save-rng", action="store_true",
                   help="Do not save the RNG states; a run loading such a checkpoint keeps its own RNG.")
    g.add_argument("--dist-ckpt-format", help="Megatron's old spelling of --ckpt-format; torch_dist only.")
    g.add_argument("--ckpt-convert-format", choices=("torch", "torch_dist", "zarr"),
                   help="Refused: convert with " + CONVERSION_TOOLS + ".")
    g.add_argument("--ckpt-convert-save", help="Refused, as --ckpt-convert-format.")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save",
                   help="Write each replicated tensor from the lowest rank holding it (fewer files with data; "
                        "the checkpoint stays loadable under any layout).")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="The state's structure is the same at every save of this run: DCP caches its save plan "
                        "and skips the plan exchange from the second save on.")


def parse_checkpoint_steps(text) -> Tuple[int, ...]:
    """'1000,5000' -> (1000, 5000); empty items are skipped (MegaDLMs' parsing)."""
    if text is None or isinstance(text, tuple):
        return text or ()
    steps = []
    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--checkpoint-steps {text!r}: {item!r} is not a positive iteration; give "
                             "comma-separated iterations such as '1000,5000'")
        steps.append(int(item))
    return tuple(sorted(set(steps)))


def validate_checkpoint_flags(args: argparse.Namespace, given: Collection[str]) -> None:
    """Refusals and ranges, one line each naming the flag and the fix."""
    if args.ckpt_format != "torch_dist" or (args.dist_ckpt_format or "torch_dist") != "torch_dist":
        flag = "--ckpt-format" if args.ckpt_format != "torch_dist" else "--dist-ckpt-format"
        raise ValueError(f"{flag} {args.dist_ckpt_format if flag != '--ckpt-format' else args.ckpt_format}: only "
                         "torch_dist checkpoints are written here (sharded, loadable under any layout); pass "
                         "--ckpt-format torch_dist, and export with " + CONVERSION_TOOLS)
    if args.ckpt_convert_format or args.ckpt_convert_save:
        raise ValueError("--ckpt-convert-format/--ckpt-convert-save (convert and exit) are not supported: convert "
                         "with " + CONVERSION_TOOLS + "; drop these flags")
    if args.non_persistent_ckpt_type == "in_memory":
        raise ValueError("--non-persistent-ckpt-type in_memory is not supported (Megatron-LM has it as 'TBD'); "
                         "use local (node-local storage) or global")
    if args.non_persistent_ckpt_type == "local" and not args.non_persistent_local_ckpt_dir:
        raise ValueError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (node-local "
                         "storage every rank writes its shards to)")
    for dest in ("non_persistent_save_interval", "ckpt_step"):
        value, lowest = getattr(args, dest), 1 if dest == "non_persistent_save_interval" else 0
        if value is not None and value < lowest:
            raise ValueError(f"--{dest.replace('_', '-')} {value} must be >= {lowest}")
    args.checkpoint_steps = parse_checkpoint_steps(args.checkpoint_steps)
    if args.non_persistent_save_interval is not None:
        _check_non_persistent_dirs(args)


def _check_non_persistent_dirs(args: argparse.Namespace) -> None:
    """The directory non-persistent saves go to is writable now, and is not --save itself (whose
    iterations --keep-last-checkpoints prunes and whose tracker names the persistent one)."""
    if args.non_persistent_ckpt_type == "global":
        flag, path = "--non-persistent-global-ckpt-dir", (args.non_persistent_global_ckpt_dir
                                                          or os.path.join(args.save, "non_persistent"))
    else:
        flag, path = "--non-persistent-local-ckpt-dir", args.non_persistent_local_ckpt_dir
    if os.path.abspath(path) == os.path.abspath(args.save):
        raise ValueError(f"{flag} {path} is --save itself; give the non-persistent checkpoints a directory of "
                         "their own (default: <--save>/non_persistent)")
    check_writable_dir(flag, path)


def check_writable_dir(flag: str, path: Optional[str]) -> None:
    """Create `path` if missing and write a file there now, so a mistyped or read-only directory
    fails at start-up instead of at the first save or index build, after the model is built
    (--save and the non-persistent directories here; arguments.py checks --data-cache-path and
    --tensorboard-dir with it too)."""
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path} is not a writable directory ({error.strerror or error}); "
                         "choose another path or fix its permissions") from None
