"""The training benchmark's results: the table it prints, the ratios between its rows and the JSON
file it writes (train_throughput.py; the other benchmarks here write their --json with `write_json`)."""

from __future__ import annotations

import json
import os
from typing import List, Optional

import torch


def write_json(path: str, result) -> None:
    """`result` as JSON at `path`, written under a temporary name and renamed when complete (every
    benchmark here writes its --json so): an earlier file is never left half overwritten."""
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle, indent=1)
    os.replace(path + ".tmp", path)


def device_name(device: torch.device) -> Optional[str]:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


TABLE_HEADER = ("| implementation | precision | parameters | median ms/step | tokens/s/GPU | TFLOP/s/GPU | MFU | "
                "tokens/s vs HF | peak memory GiB |\n|---|---|---|---|---|---|---|---|---|")


def format_row(row: dict, baseline: Optional[dict] = None) -> str:
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    versus = "-" if baseline is None else f"{row['tokens_per_sec_per_gpu'] / baseline['tokens_per_sec_per_gpu']:.3f}x"
    return (f"| {row['name']} | {row['precision']} | {row['parameters'] / 1e6:,.1f}M | {row['median_step_ms']:.1f} | "
            f"{row['tokens_per_sec_per_gpu']:,.0f} | {row['tflops_per_gpu']:.2f} | {mfu} | {versus} | "
            f"{'-' if row['peak_memory_gib'] is None else format(row['peak_memory_gib'], '.1f')} |")


def _baseline_flops(result: dict) -> str:
    """The HF step's count where it differs from ours (it takes logits at every position)."""
    hf = result.get("hf_flops_per_step")
    return f" (HF's step: {hf / 1e9:,.1f}, logits at every position)" if hf and hf != result["flops_per_step"] else ""


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(f"\n{cfg['model']} ({cfg['mode']}, {result['attention_mask_type']}), seq {cfg['seq_length']} x micro-batch "
          f"{cfg['micro_batch_size']} x {cfg['accumulation']} accumulated, {cfg['steps']} timed steps after "
          f"{cfg['warmup']}, {result['device']}, "
          f"{result['flops_per_step'] / 1e9:,.1f} GFLOP per step" + _baseline_flops(result))
    print(TABLE_HEADER)
    baseline = result["rows"][-1] if cfg["baseline"] == "hf" else None
    for row in result["rows"]:
        print(format_row(row, baseline))
    if baseline is not None and baseline.get("experts_implementation"):
        print(f"HF experts implementation: {baseline['experts_implementation']} (--hf-experts-implementation)")
    for label, key in (("ours / baseline", "ratio"), ("grouped GEMM / per-expert loop", "grouped_gemm_ratio")):
        if result.get(key):
            print(f"{label}: tokens/s {result[key]['tokens_per_sec_per_gpu']:.3f}x, "
                  f"TFLOP/s {result[key]['tflops_per_gpu']:.3f}x")
    if result.get("fp8_ratio"):
        print("fp8 tokens/s: " + ", ".join(f"{value:.3f}x {name.replace('_', ' ')}"
                                           for name, value in result["fp8_ratio"].items()))


def ratios(rows: List[dict], baseline: bool, fp8: bool, variants: int) -> dict:
    """Our first row over the baseline, fp8 over our bf16 row (the first fp8 row follows our
    `variants` bf16 rows) and, with both expert paths, the grouped-GEMM row over the per-expert loop."""
    keys = ("tokens_per_sec_per_gpu", "tflops_per_gpu")

    def over(row: dict, base: dict) -> dict:
        return {key: row[key] / base[key] for key in keys}

    fp8_ratio = {"over_ours": over(rows[variants], rows[0])[keys[0]]} if fp8 else None
    if fp8 and baseline:
        fp8_ratio["over_baseline"] = over(rows[variants], rows[-1])[keys[0]]
    return {"ratio": over(rows[0], rows[-1]) if baseline else None, "fp8_ratio": fp8_ratio,
            "grouped_gemm_ratio": over(rows[0], rows[1]) if variants == 2 else None}
