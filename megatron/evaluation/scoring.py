"""Batched log-likelihood of many (context, continuation) pairs: what an evaluation harness asks.

`megatron.core.inference.likelihood.log_likelihood` scores one pair per call; a benchmark has
thousands of them (every choice of every question), so this scorer packs the rows of many pairs
into fixed-size batches instead. The estimate is the same:

* Autoregressive (``vanilla``) models: exact. One row per pair; the rows, sorted by length
  (longest first, so the first batch shows the peak memory), go ``batch_size`` to a forward;
  the continuation's log-probability is summed and ``is_greedy`` says whether every
  continuation token is the argmax of its position (exact, as lm-eval's own models report it).
* Diffusion models (``difflm-noshift`` / ``difflm-shift``): LLaDA's Monte Carlo ELBO on the
  continuation only, ``mc_num`` masked copies per pair, the masked counts stratified over all
  ``mc_num`` copies with one random offset (likelihood.py with ``batch_size == mc_num``; the
  draws are those of that function, so a pair scored alone here and there gives the same
  number). The copies of all pairs form one stream of rows, pairs sorted by length, cut into
  batches of ``batch_size`` rows (each row doubled under classifier-free guidance ``cfg``).
  A mask drawn several times for one pair runs once, weighted by its count: the same estimate
  with fewer rows (a one-token continuation is one row, not ``mc_num``).
  Block-diffusion models (BD3-LM) take likelihood.py's block-wise ELBO: each model block's part
  of the continuation gets its own ``mc_num`` draws (in block order, from the pair's generator),
  its rows masking that part only with every earlier block clean.
  ``is_greedy`` is always False: deciding it needs the argmax decoding of the continuation
  (one forward per token, LLaDA's slow ``is_check_greedy``), and a masked model's one-shot
  argmax under a fully masked continuation is not the same question.

Only the scored slots' logits are read: with ``select=True`` the model callable takes
``select=`` ((rows, positions) index tensors) and applies its output layer at those positions only
(`GPTModel.inference_forward`, the export's ``dlm_forward``); otherwise it returns the full
[B, L, V] logits and the scorer picks them (a native transformers model). The numbers agree.

Every pair draws its masks from its own CPU generator, seeded by the caller (`pair_seed`:
the run's seed and the context's tokens), so the choices of one question share their random
numbers (common random numbers: the score differences between choices have less noise), and
a result does not depend on the batch it ran in, the batch size, or the other requests.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron.core.inference.generation import ModelFn, canvas_layout, guided, resolve_options
from megatron.core.inference.likelihood import answer_spans, draw_masks

__all__ = ["Scorer", "pair_seed"]

Pair = Tuple[Sequence[int], Sequence[int]]


def pair_seed(seed: int, context: Sequence[int]) -> int:
    """The mask seed of a pair: the run's seed mixed with its context's tokens (not its
    continuation), so every choice of a question draws the same numbers."""
    digest = zlib.crc32(",".join(map(str, context)).encode())
    return (seed * 1_000_003 + digest) % (2 ** 63)


@dataclass
class _Row:
    """One model input row of a pair: its tokens, the slots scored, their targets and weight."""

    pair: int
    ids: torch.Tensor  # [L] input (masked for DLMs)
    scored: torch.Tensor  # [L] bool: the slots whose loss counts
    targets: torch.Tensor  # [L] the token each slot's logits score
    weight: float  # copies * A / l for DLMs (a mask drawn `copies` times runs once), 1 for AR
    unconditional: Optional[torch.Tensor] = None  # [L] CFG input: the context masked too


class Scorer:
    """Scores pairs with a model callable (`generation.py`'s ``model_fn``) in its running mode and
    trained attention pattern; see the module docstring for the estimates."""

    def __init__(self, model_fn: ModelFn, running_mode: str, mask_token_id: Optional[int], device: torch.device,
                 *, batch_size: int = 32, mc_num: int = 128, cfg: float = 0.0, pattern: Optional[dict] = None,
                 select: bool = False, dedupe: bool = True):
        for name, value in (("batch_size", batch_size), ("mc_num", mc_num)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if cfg < 0:
            raise ValueError(f"cfg={cfg!r} must be >= 0 (0 disables guidance)")
        if running_mode != "vanilla" and not isinstance(mask_token_id, int):
            raise ValueError(f"running_mode={running_mode!r} needs a mask token id; the checkpoint records none")
        self.model_fn, self.running_mode, self.mask_token_id = model_fn, running_mode, mask_token_id
        self.device = device
        self.batch_size, self.mc_num, self.cfg = batch_size, mc_num, cfg
        self.dedupe = dedupe  # equal masked copies of a pair run once (`_distinct`)
        self.select = select  # model_fn takes select= (GPTModel.inference_forward, the export's dlm_forward)
        self.opts = resolve_options(running_mode, gen_length=1, **(pattern or {}))
        self.block = self.opts.attention_block_size if self.opts.attention_mask_type == "block_diffusion" else None
        """Block diffusion: the model's block size; each block's part of a continuation is masked alone."""

    @torch.no_grad()
    def score(self, pairs: Sequence[Pair], seeds: Sequence[int]) -> List[Tuple[float, bool]]:
        """(log-likelihood in nats, is_greedy) of each continuation given its context."""
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("a continuation is empty: there is nothing to score")
            if self.running_mode != "difflm-noshift" and not context:
                raise ValueError(f"running_mode={self.running_mode!r} scores token i with the logits at i - 1: "
                                 "every context needs at least one token")
        order = sorted(range(len(pairs)), key=lambda index: -(len(pairs[index][0]) + len(pairs[index][1])))
        # On the device, read once at the end: no batch waits for the last one's numbers, so the
        # host builds the next batch while the device runs this one.
        totals = torch.zeros(len(pairs), dtype=torch.float64, device=self.device)
        greedy = torch.ones(len(pairs), dtype=torch.bool, device=self.device)
        batch: List[_Row] = []
        for row in self._rows(pairs, seeds, order):
            batch.append(row)
            if len(batch) == self.batch_size:
                self._run(batch, totals, greedy)
                batch = []
        if batch:
            self._run(batch, totals, greedy)
        totals, greedy = totals.cpu(), greedy.cpu()
        if self.running_mode != "vanilla":
            return [(-(total / self.mc_num), False) for total in totals.tolist()]
        return list(zip(totals.tolist(), greedy.tolist()))

    def _rows(self, pairs: Sequence[Pair], seeds: Sequence[int], order: Sequence[int]) -> Iterator[_Row]:
        """Rows pair by pair in `order`, made lazily: a benchmark's masked copies never all sit in memory."""
        for index in order:
            context, continuation = pairs[index]
            sequence = torch.tensor(list(context) + list(continuation), dtype=torch.long)
            prompt, length = len(context), len(continuation)
            if self.running_mode == "vanilla":  # slot i's logits score token i + 1: the last token is no input
                scored = torch.zeros(sequence.numel() - 1, dtype=torch.bool)
                scored[prompt - 1:] = True
                yield _Row(index, sequence[:-1], scored, sequence[1:], 1.0)
                continue
            # The shift mode's slot i reads the logits at i - 1 (_run moves them), so targets stay in place.
            generator = torch.Generator().manual_seed(int(seeds[index]))
            for start, end in answer_spans(prompt, prompt + length, self.block):
                masked = draw_masks(end - start, self.mc_num, generator)[1]
                for pattern, copies in self._distinct(masked):
                    yield self._masked_row(index, sequence, prompt, start, pattern, copies)

    def _masked_row(self, index: int, sequence: torch.Tensor, prompt: int, start: int, pattern: torch.Tensor,
                    copies: int) -> _Row:
        """The row masking `pattern` from slot `start` on (every other slot clean), weighted by its
        copies times the span's length over its masked count."""
        scored = torch.zeros(sequence.numel(), dtype=torch.bool)
        scored[start:start + pattern.numel()] = pattern
        noisy = sequence.masked_fill(scored, self.mask_token_id)
        unconditional = None
        if self.cfg > 0:
            unconditional = noisy.clone()
            unconditional[:prompt] = self.mask_token_id
        return _Row(index, noisy, scored, sequence, copies * pattern.numel() / int(pattern.sum()), unconditional)

    def _distinct(self, masked: torch.Tensor) -> List[Tuple[torch.Tensor, int]]:
        """(mask, copies) of each distinct draw. Equal masks give equal rows and equal losses, so a
        mask drawn k times runs once with k times its weight: the estimate is unchanged. A short
        continuation has few masks (2^A - 1): with A = 1 all mc_num copies are one row.
        `dedupe=False` runs every copy (LLaDA's way), to measure this."""
        if not self.dedupe:
            return [(pattern, 1) for pattern in masked]
        patterns, copies = torch.unique(masked, dim=0, return_counts=True)
        return list(zip(patterns, copies.tolist()))

    def _run(self, rows: List[_Row], totals: torch.Tensor, greedy: torch.Tensor) -> None:
        """One forward over `rows` (left-padded to the longest); adds each row's score to its pair.
        Everything is indexed on the host and copied without waiting: no host sync here."""
        width = max(row.ids.numel() for row in rows)
        ids, scored, real = self._stacked([row.ids for row in rows], width), [], []
        for row in rows:
            pad = width - row.ids.numel()
            scored.append(F.pad(row.scored, (pad, 0)))
            real.append(F.pad(torch.ones_like(row.scored), (pad, 0)))
        scored, real = torch.stack(scored), torch.stack(real)
        # The positions whose logits score a slot: the slot itself, or (difflm-shift) the one before it.
        read = F.pad(scored[:, 1:], (0, 1)) if self.running_mode == "difflm-shift" else scored
        row_of, columns = read.nonzero(as_tuple=True)  # row-major, as scored's: the same rows
        wanted = self._stacked([row.targets for row in rows], width)[scored]
        if self.cfg > 0 and self.running_mode != "vanilla":
            ids = torch.cat([ids, self._stacked([row.unconditional for row in rows], width)])
            real, row_of, columns = real.repeat(2, 1), torch.cat([row_of, row_of + len(rows)]), columns.repeat(2)
        layout = canvas_layout(self._to_device(real), 0, self.opts)
        read = (self._to_device(row_of), self._to_device(columns))
        # Causal clean blocks (a joint AR + DLM model's): each row's blocks before its masked span are clean.
        noisy_from = self._to_device(scored.int().argmax(dim=1).repeat(len(ids) // len(rows)))
        picked = self._logits(self._to_device(ids), layout.positions,
                              layout.attention_mask(0, width, width, noisy_from), read).float()
        wanted, row_of, pair_of = self._to_device(wanted), read[0][:wanted.numel()], [row.pair for row in rows]
        if self.running_mode == "vanilla":
            self._add_exact(len(rows), picked, wanted, row_of, pair_of, totals, greedy)
            return
        if self.cfg > 0:  # the vocabulary padding is -inf in both halves and stays so
            picked = guided(*picked.chunk(2), self.cfg)
        loss = F.cross_entropy(picked, wanted, reduction="none").double()
        per_row = torch.zeros(len(rows), dtype=torch.float64, device=self.device).index_add_(0, row_of, loss)
        weights = self._to_device(torch.tensor([row.weight for row in rows], dtype=torch.float64))
        totals.index_add_(0, self._to_device(torch.tensor(pair_of)), per_row * weights)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                read: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[n, V] logits at the `read` (rows, positions) slots. With `select` the model applies its
        output layer there only: the full [B, L, V] logits (tens of GB a batch at a 150k
        vocabulary, of which a few slots a row are read) are never made."""
        if self.select:
            return self.model_fn(ids, positions, mask, None, 0, select=read)
        return self.model_fn(ids, positions, mask, None, 0)[read]

    def _add_exact(self, rows: int, picked: torch.Tensor, wanted: torch.Tensor, row_of: torch.Tensor,
                   pair_of: List[int], totals: torch.Tensor, greedy: torch.Tensor) -> None:
        picked = picked.log_softmax(dim=-1)
        logprob = picked.gather(1, wanted[:, None])[:, 0].double()
        hit = picked.argmax(dim=-1) == wanted
        per_row = torch.zeros(rows, dtype=torch.float64, device=self.device).index_add_(0, row_of, logprob)
        misses = torch.zeros(rows, dtype=torch.long, device=self.device).index_add_(0, row_of, (~hit).long())
        index = self._to_device(torch.tensor(pair_of))
        totals.index_add_(0, index, per_row)
        # A pair's rows may span two batches: AND into its flag (each pair has one row in vanilla).
        greedy.index_put_((index,), greedy[index] & (misses == 0))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without a host sync: through pinned memory on CUDA (a plain
        copy from pageable memory waits for the device's queue)."""
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _stacked(self, sequences: List[torch.Tensor], width: int) -> torch.Tensor:
        """[n, width] on the host, left-padded with token 0 (padding is never attended)."""
        return torch.stack([F.pad(ids, (width - ids.numel(), 0)) for ids in sequences])
