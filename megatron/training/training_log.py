"""Console lines in Megatron-LM's format, tensorboard scalars and optional wandb.

The console line keeps Megatron's field names and number formats so existing log parsers
work: `iteration  N/ M | consumed samples: ... | lm loss: 1.234567E+00 | ...`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from datetime import datetime
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.data_parallel import unwrap
from megatron.core.pipeline_parallel.chunks import model_chunks
from megatron.training import flops
from megatron.training.configs import LoggingConfig, RunRecord, TrainingConfig
from megatron.training.initialize import Runtime
from megatron.training.timers import Timers


def _open_wandb(config: LoggingConfig, run: dict):
    """wandb is optional and imported here only."""
    try:
        import wandb
    except ImportError as error:
        raise SystemExit("--wandb-project needs the wandb package: pip install 'megadlms[wandb]'") from error
    return wandb.init(**wandb_init_kwargs(config, run))


def wandb_init_kwargs(config: LoggingConfig, run: dict) -> dict:
    """wandb.init's arguments from the --wandb-* flags (MegaDLMs' set; --wandb-entity Megatron's).
    Optional ones are passed only when given, so older wandb releases accept the call."""
    tags = [tag.strip() for tag in (config.wandb_tags or "").split(",") if tag.strip()]
    kwargs = dict(project=config.wandb_project, name=config.wandb_exp_name, config=run, id=config.wandb_run_id,
                  mode=config.wandb_mode, tags=tags or None, group=config.wandb_group, notes=config.wandb_notes,
                  dir=config.wandb_save_dir)
    if config.wandb_resume_from:  # a fork of an earlier run's history: wandb refuses it with resume=
        kwargs["resume_from"] = config.wandb_resume_from
    else:
        kwargs["resume"] = config.wandb_resume
    if config.wandb_entity:
        kwargs["entity"] = config.wandb_entity
    if config.wandb_save_dir:
        os.makedirs(config.wandb_save_dir, exist_ok=True)
    return kwargs


def cuda_memory_scalars(device: torch.device) -> Dict[str, float]:
    """--log-memory-to-tensorboard: the caching allocator's statistics, under Megatron's names."""
    stats = torch.cuda.memory_stats(device)
    return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0)}


def _rate(value: float) -> str:
    """Megatron's one decimal, or two significant digits below 1 (a CPU run shows 0.0021, not 0.0)."""
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.2g}"


def _tflop(flops_count: float) -> str:
    """TFLOP with three decimals, or four significant digits below 1 (a small model's count is not 0.000)."""
    value = flops_count / 1e12
    return f"{value:.3f}" if value >= 1 else f"{value:.4g}"


class TrainingLogger:
    """Everything printed or recorded during training; only rank 0 writes."""

    def __init__(self, config: LoggingConfig, training: TrainingConfig, record: RunRecord, runtime: Runtime) -> None:
        self.config, self.training, self.record, self.runtime = config, training, record, runtime
        model, dlm = record.transformer_config, record.dlm_config
        self.flops_per_iteration = flops.executed_flops_per_iteration(model, dlm, training.seq_length,
                                                                      training.global_batch_size)
        """What the step executes (the output layer at the masked positions only under masked-only loss):
        every TFLOP/s and MFU of the run is counted with it."""
        self.megatron_flops_per_iteration = flops.training_flops_per_iteration(
            model, training.seq_length, training.global_batch_size, mask_type=dlm.effective_mask_type,
            block_size=dlm.block_size, window=model.sliding_window)
        """Megatron's formula (the output layer at every position), printed beside it in the header."""
        device_name = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else None
        self.peak = flops.peak_tflops(device_name, "bf16")
        self.fp8_peak: Optional[float] = None
        """With fp8 training, the card's fp8 peak: the MFU is then stated against both."""
        self.writer = self.wandb = None
        if runtime.is_main and config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=config.tensorboard_queue_size)
        if runtime.is_main and config.wandb_project:
            self.wandb = _open_wandb(config, {"training": dataclasses.asdict(training),
                                              "logging": dataclasses.asdict(config),
                                              "dlm": dataclasses.asdict(record.dlm_config),
                                              "model": {k: str(v) for k, v in
                                                        dataclasses.asdict(record.transformer_config).items()}})
        self.timers = Timers(config.timing_log_level, config.timing_log_option, runtime.device)
        if config.log_memory_to_tensorboard and runtime.device.type != "cuda":
            self.print("> --log-memory-to-tensorboard: no CUDA device, so no memory statistics on CPU")
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_start = time.perf_counter()
        self.window_loss = self.window_steps = self.window_counted = 0
        self.window_parts: Dict[str, float] = {}  # the loss's named terms, summed as window_loss

    def print(self, message: str) -> None:
        if self.runtime.is_main:
            print(message, flush=True)

    def count_fp8_peak(self) -> None:
        """fp8 training: the MFU on the console is stated against the card's fp8 peak as well (the
        matmuls the fp8 layers run use it; attention and the output layer stay bf16)."""
        device = self.runtime.device
        self.fp8_peak = flops.peak_tflops(torch.cuda.get_device_name(device), "fp8") if device.type == "cuda" else None

    def log_start(self, model: nn.Module, state=None) -> None:
        """The run's headline, the parallel layout and, with pipelining, the stage table
        (a collective over the pipeline group: every rank calls it)."""
        training, record = self.training, self.record
        stages = pipeline_stages(model, state)
        params = sum(stage["params"] for stage in stages)
        bd3 = (" over [x_t ; x_0]: a 2L-token forward, its mask's density counted"
               if record.dlm_config.block_diffusion else "")
        megatron = ""
        if self.megatron_flops_per_iteration != self.flops_per_iteration:
            megatron = (f" (Megatron's formula, the output layer at every position: "
                        f"{_tflop(self.megatron_flops_per_iteration)})")
        self.print(f"> MegaDLMs: {record.dlm_config.model_running_mode} "
                   f"(attention {record.dlm_config.effective_mask_type}{bd3}), {params / 1e6:.2f}M parameters, "
                   f"{_tflop(self.flops_per_iteration)} TFLOP per iteration{megatron}")
        self.print("> parallel layout\n" + (state.layout_table() + "\n" if state is not None else "") +
                   f"  sequence parallel: {record.sequence_parallel}, data-parallel sharding: "
                   f"{record.data_parallel_sharding_strategy}, micro-batch {training.micro_batch_size} x "
                   f"{training.num_microbatches} accumulation x {record.data_parallel_size} replicas = global batch "
                   f"{training.global_batch_size}")
        if len(stages) > 1:
            self.print(stage_table(stages))

    def _scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def on_step(self, state, result, learning_rate: float, loss_scale: float) -> None:
        if not result.skipped:
            self.window_loss += result.loss
            self.window_counted += 1
            for name, value in getattr(result, "parts", {}).items():
                self.window_parts[name] = self.window_parts.get(name, 0.0) + value
        self.window_steps += 1
        if state.iteration % self.config.tensorboard_log_interval == 0:
            self._step_scalars(state, result, learning_rate, loss_scale)
        if state.iteration % self.config.log_interval:
            return
        timers = self.timers.gather() if self.timers.level >= 1 else {}  # a collective: every rank is here
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        seconds = (time.perf_counter() - self.window_start) / self.window_steps
        loss = self.window_loss / max(self.window_counted, 1)
        batch = getattr(result, "global_batch_size", 0) or self.training.global_batch_size  # a ramp's current one
        tokens = batch * self.training.seq_length
        # A block-size curriculum's size of the window's last step (DLMConfig.at_iteration; 0-based), whose
        # attention the FLOPs count.
        dlm = self.record.dlm_config.at_iteration(state.iteration - 1)
        scheduled = bool(dlm.block_size_schedule)
        per_iteration = self.flops_per_iteration if not scheduled else flops.executed_flops_per_iteration(
            self.record.transformer_config, dlm, self.training.seq_length, self.training.global_batch_size)
        rates = flops.throughput_metrics(per_iteration * batch / self.training.global_batch_size, tokens,
                                         seconds, self.record.world_size, self.peak)
        numerics = getattr(result, "numerics", None)  # params norm, zeros in the gradients (rerun.py)
        terms = tuple(f"{name}: {value / max(self.window_counted, 1):.6E}" for name, value in self.window_parts.items())
        line = self._line(state, seconds, learning_rate, loss, loss_scale, result.grad_norm, rates, batch,
                          (*terms, *(numerics.console_parts() if numerics is not None else ())))
        moe = getattr(result, "moe", None)
        self.print(line + (f" {moe.summary()} |" if moe is not None else "") + (f" block size: {dlm.block_size} |"
                                                                                 if scheduled else ""))
        report = self.timers.report(timers, self.window_steps)
        if report:
            self.print(report)
        values = {"iteration-time": seconds, "consumed-tokens": state.consumed_train_tokens,
                  "throughput/tokens-per-sec-per-gpu": rates["tokens_per_sec_per_gpu"],
                  "throughput/tflops-per-gpu": rates["tflops_per_gpu"]}
        if rates["mfu"] is not None:
            values["throughput/mfu"] = rates["mfu"]
        if moe is not None:  # the last step of the window (Megatron logs MoE losses per step too)
            values.update(moe.scalars())
        if scheduled:
            values["block-size"] = dlm.block_size
        if numerics is not None:
            values.update(numerics.all_scalars())
        if self.runtime.device.type == "cuda":
            values["memory/max-allocated-gib"] = torch.cuda.max_memory_allocated(self.runtime.device) / 2 ** 30
        if self.config.log_timers_to_tensorboard:  # seconds per step, the slowest rank's (Megatron's)
            values.update({f"{name}-time": max(times) / self.window_steps for name, times in timers.items()})
        self._scalars(values, state.iteration)
        self._reset_window()

    def _line(self, state, seconds, learning_rate, loss, loss_scale, grad_norm, rates, batch: int,
              numerics: Sequence[str] = ()) -> str:
        training = self.training
        parts = [f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {state.iteration:8d}/{training.train_iters:8d}",
                 f"consumed samples: {state.consumed_train_samples:12d}",
                 f"elapsed time per iteration (ms): {seconds * 1000:.1f}"]
        if self.config.log_throughput:
            parts.append(f"throughput per GPU (TFLOP/s/GPU): {_rate(rates['tflops_per_gpu'])}")
            parts.append(f"tokens per second per GPU: {rates['tokens_per_sec_per_gpu']:.1f}")
            if rates["mfu"] is not None and self.fp8_peak:
                parts.append(f"MFU: {100 * rates['mfu']:.1f}% of the bf16 peak, "
                             f"{100 * rates['tflops_per_gpu'] / self.fp8_peak:.1f}% of the fp8 peak")
            elif rates["mfu"] is not None:
                parts.append(f"MFU: {100 * rates['mfu']:.1f}%")
        parts += [f"learning rate: {learning_rate:.6E}", f"global batch size: {batch:5d}",
                  f"lm loss: {loss:.6E}", f"loss scale: {loss_scale:.1f}", f"grad norm: {grad_norm:.3f}", *numerics,
                  f"number of skipped iterations: {state.skipped_iterations:3d}",
                  f"number of nan iterations: {state.nan_iterations:3d}"]
        if self.runtime.device.type == "cuda":
            parts.append(f"mem max allocated (GiB): "
                         f"{torch.cuda.max_memory_allocated(self.runtime.device) / 2 ** 30:.2f}")
        return " | ".join(parts) + " |"

    def _step_scalars(self, state, result, learning_rate: float, loss_scale: float) -> None:
        """Megatron's per-step scalars, every --tensorboard-log-interval steps; tensorboard also gets
        them against consumed samples (`<name> vs samples`)."""
        if self.writer is None and self.wandb is None:
            return
        config = self.config
        values = {"grad-norm": result.grad_norm, "skipped-iterations": state.skipped_iterations,
                  "nan-iterations": state.nan_iterations}
        if math.isfinite(result.loss):
            values["lm loss"] = result.loss
            values.update(getattr(result, "parts", {}))
        if config.log_learning_rate_to_tensorboard:
            values["learning-rate"] = learning_rate
        if config.log_batch_size_to_tensorboard:
            values["batch-size"] = getattr(result, "global_batch_size", 0) or self.training.global_batch_size
        if config.log_loss_scale_to_tensorboard:
            values["loss-scale"] = loss_scale
        if config.log_world_size_to_tensorboard:
            values["world-size"] = self.record.world_size
        if config.log_memory_to_tensorboard and self.runtime.device.type == "cuda":
            values.update(cuda_memory_scalars(self.runtime.device))
        self._scalars(values, state.iteration)
        if self.writer is not None:
            for name in ("lm loss", "learning-rate", "batch-size", "loss-scale", "world-size", "grad-norm"):
                if name in values:
                    self.writer.add_scalar(f"{name} vs samples", values[name], state.consumed_train_samples)

    def on_timer(self, name: str, seconds: float, iteration: int) -> None:
        """A timed evaluation or save (this rank's time): `<name>-time` with --log-timers-to-tensorboard."""
        if self.config.log_timers_to_tensorboard:
            self._scalars({f"{name}-time": seconds}, iteration)

    def on_validation(self, state, loss: float, parts: Optional[Dict[str, float]] = None) -> None:
        """The validation line and scalars; `parts`: the loss's named terms (the joint objective's)."""
        ppl = math.exp(min(loss, 20.0))
        terms = "".join(f" {name} value: {value:.6E} |" for name, value in (parts or {}).items())
        line = (f" validation loss at iteration {state.iteration} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} |{terms}")
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        values = {"lm loss validation": loss, **{f"{name} validation": value for name, value in (parts or {}).items()}}
        if self.config.log_validation_ppl_to_tensorboard:  # for a DLM: exp of the ELBO bound
            values["lm loss validation ppl"] = ppl
        self._scalars(values, state.iteration)
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(f"{name} vs samples", value, state.consumed_train_samples)

    def on_scalars(self, values: Dict[str, float], iteration: int) -> None:
        """Scalars another part of the run computed at `iteration` (the in-loop lm-eval metrics)."""
        self._scalars(values, iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def pipeline_stages(model: nn.Module, state=None) -> List[dict]:
    """Per pipeline stage: its chunks' global layer ranges, its parameters (whole-model
    equivalents: tp-sharded weights count tp times, experts etp x ep times; a tied embedding's
    copy on the last stage not at all), and whether it holds the embedding and the output layer.
    Gathered over the pipeline group (one entry without pipelining)."""
    chunks = [unwrap(chunk) for chunk in model_chunks(model)]
    mine = {"layers": [getattr(getattr(c, "decoder", None), "layer_range", None) for c in chunks],
            "params": sum(p.numel() * _copies(p, state) for p in model.parameters()
                          if not getattr(p, "tied_embedding_copy", False)),
            "embedding": any(getattr(c, "pre_process", False) for c in chunks),
            "output": any(getattr(c, "post_process", False) for c in chunks)}
    if state is None or state.pp == 1:
        return [mine]
    stages = [None] * state.pp
    dist.all_gather_object(stages, mine, group=state.groups.pp)
    return stages


def _copies(param: nn.Parameter, state) -> int:
    """How many ranks' pieces make up the whole of `param`: a tp split, or an expert weight split
    over ep (and etp, except the etp-replicated biases)."""
    if state is None:
        return 1
    if getattr(param, "expert_parallel", False):
        return state.ep * (1 if getattr(param, "allreduce_over_expert_tp", False) else state.etp)
    return state.tp if getattr(param, "tensor_model_parallel", False) else 1


def stage_table(stages: List[dict]) -> str:
    rows = ["> pipeline stages (layers are global indices [start, end), one range per virtual stage)",
            f"  {'stage':>5}  {'layers':<28} {'parameters':>12}  embedding  output"]
    for index, stage in enumerate(stages):
        ranges = " ".join(f"[{r[0]},{r[1]})" for r in stage["layers"] if r)
        rows.append(f"  {index:>5}  {ranges:<28} {stage['params'] / 1e6:>11.2f}M  "
                    f"{'yes' if stage['embedding'] else 'no':<9}  {'yes' if stage['output'] else 'no'}")
    return "\n".join(rows)
