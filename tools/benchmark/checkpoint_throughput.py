"""Checkpoint save and load throughput, and how long an async save blocks training.

    python tools/benchmark/checkpoint_throughput.py --layers 16 --dir /tmp/ckpt_bench [--repeats 3] [--json OUT]

Builds the 1.7B launch script's shape (hidden 2048, 16 heads, 8 kv heads, ffn 6144, vocab
151,936) with `--layers` layers on one device, with fp32 weights and AdamW state (what
`--save` writes: weights + exp_avg + exp_avg_sq), then times, each `--repeats` times:
- a synchronous save (`serialization.save`, what `--save` does without `--async-save`);
- an async save: the blocking part (staging to pinned host memory, what the training loop
  waits for) and the total until the background write finished;
- a load into the same tensors (`serialization.load`).
GB/s counts the bytes of the tensors written. Prints a table (medians) and optional JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron.core.dist_checkpointing import serialization  # noqa: E402
from megatron.core.dist_checkpointing.model_state import (model_sharded_state_dict,  # noqa: E402
                                                          optimizer_sharded_state_dict)
from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig  # noqa: E402


def build(layers: int, hidden: int, vocab: int, device: torch.device):
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 128),
                               num_query_groups=max(1, hidden // 256), ffn_hidden_size=3 * hidden,
                               vocab_size=vocab, qk_layernorm=True, share_embeddings_and_output_weights=True)
    with torch.device(device):
        model = GPTModel(config, DLMConfig(mask_token_id=vocab - 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # creates exp_avg / exp_avg_sq
    sharded = model_sharded_state_dict(model)
    sharded.update(optimizer_sharded_state_dict(model, optimizer))
    return model, sharded


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(sharded: dict, directory: str, repeats: int, device: torch.device) -> dict:
    times = {"save": [], "async_blocking": [], "async_total": [], "load": []}
    for repeat in range(repeats):
        target = os.path.join(directory, f"sync_{repeat}")
        _synchronise(device)
        start = time.perf_counter()
        serialization.save(sharded, target)
        times["save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        serialization.load(sharded, target)
        _synchronise(device)
        times["load"].append(time.perf_counter() - start)
        target = os.path.join(directory, f"async_{repeat}")
        start = time.perf_counter()
        future = serialization.save_async(sharded, target)
        times["async_blocking"].append(time.perf_counter() - start)
        future.result()
        times["async_total"].append(time.perf_counter() - start)
        shutil.rmtree(os.path.join(directory, f"sync_{repeat}"))
        shutil.rmtree(target)
    return {name: statistics.median(values) for name, values in times.items()} | {"all": times}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--dir", required=True, help="Where the checkpoints are written (removed afterwards).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, sharded = build(args.layers, args.hidden_size, args.vocab_size, device)
    parameters = sum(p.numel() for p in model.parameters())
    size = sum(piece.data.numel() * piece.data.element_size() for piece in sharded.values())
    os.makedirs(args.dir, exist_ok=True)
    first = measure(sharded, args.dir, 1, device)  # warm-up: allocates the pinned staging buffers
    result = measure(sharded, args.dir, args.repeats, device)
    result["first_async_blocking"] = first["async_blocking"]
    result.update(parameters=parameters, bytes=size, device=torch.cuda.get_device_name() if device.type == "cuda"
                  else "cpu", torch=torch.__version__, command=" ".join(sys.argv))
    gigabytes = size / 1e9
    print(f"{parameters / 1e9:.2f}B parameters, {gigabytes:.1f} GB written (fp32 weights + AdamW state), "
          f"{result['device']}, median of {args.repeats}")
    print("| operation | seconds | GB/s |")
    print("|---|---|---|")
    for name, label in (("save", "sync save"), ("first_async_blocking", "first async save: training blocked"),
                        ("async_blocking", "async save: training blocked"),
                        ("async_total", "async save: until written"), ("load", "load")):
        print(f"| {label} | {result[name]:.2f} | {gigabytes / result[name]:.1f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
