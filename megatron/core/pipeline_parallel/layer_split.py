"""How the transformer layers are split over pipeline ranks and their virtual stages (Megatron-LM's rules).

With `P` pipeline ranks and `V` virtual stages (model chunks) per rank, there are `P * V` virtual
stages, numbered `s = vp_stage * P + pipeline_rank`, and the layers are laid out contiguously in
that order: virtual stage `s` holds layers `[sum(counts[:s]), sum(counts[:s + 1]))`. So rank 0
holds the first chunk, rank 1 the next, ..., then rank 0 again. Eight layers, `P = 2`, `V = 2`:

    counts = [2, 2, 2, 2]        s=0: rank 0 chunk 0 -> layers 0-1     s=1: rank 1 chunk 0 -> 2-3
                                 s=2: rank 0 chunk 1 -> layers 4-5     s=3: rank 1 chunk 1 -> 6-7

`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` give the first / last
rank its own total (split evenly over its chunks) and the other ranks share the rest evenly:
8 layers, `P = 3`, first 3, last 1 -> `[3, 4, 1]`. `--account-for-embedding-in-pipeline-split`
(`--account-for-loss-in-pipeline-split`) counts the embedding (the loss) as one layer of the first
(last) virtual stage: 7 layers, `P = 2`, embedding -> 8 split as `[4, 4]`, minus one -> `[3, 4]`.

Pure arithmetic, no process groups: the flags (megatron/training/arguments.py) compute the split
once; the model builds the layers of its own chunks from it.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

PP_FLAG = "--pipeline-model-parallel-size"
FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYERS_PER_VIRTUAL_FLAG = "--num-layers-per-virtual-pipeline-stage"
VIRTUAL_STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"


def _check_sizes(num_layers: int, pipeline_size: int, virtual_size: Optional[int]) -> int:
    """The number of chunks per rank (1 without interleaving), after checking the sizes."""
    if num_layers < 1:
        raise ValueError(f"--num-layers {num_layers} must be >= 1")
    if pipeline_size < 1:
        raise ValueError(f"{PP_FLAG} {pipeline_size} must be >= 1")
    virtual = 1 if virtual_size is None else virtual_size
    if virtual < 1:
        raise ValueError(f"{VIRTUAL_STAGES_FLAG} {virtual} must be >= 1")
    if virtual > 1 and pipeline_size == 1:
        raise ValueError(f"{VIRTUAL_STAGES_FLAG} {virtual} (virtual pipeline stages) needs {PP_FLAG} > 1; "
                         f"drop it or raise {PP_FLAG}")
    return virtual


def _even_rank_layers(num_layers: int, pipeline_size: int, virtual: int, extra: int) -> List[int]:
    """Every rank's share of `num_layers + extra` (the embedding and loss counted as layers)."""
    total = num_layers + extra
    if total % (pipeline_size * virtual):
        counted = f" + {extra} (the embedding/loss counted as layers)" if extra else ""
        over = f"{PP_FLAG} {pipeline_size}" + (f" x {virtual} virtual stages per rank" if virtual > 1 else "")
        other = "drop the account-for flags" if extra else f"give {FIRST_FLAG} / {LAST_FLAG}"
        raise ValueError(f"--num-layers {num_layers}{counted} is not divisible by {over}; change --num-layers or "
                         f"the sizes, or {other}")
    return [total // pipeline_size] * pipeline_size


def _uneven_rank_layers(num_layers: int, pipeline_size: int, virtual: int, first: Optional[int],
                        last: Optional[int]) -> List[int]:
    """Every rank's layers when the first and/or last rank has its own total; the rest share evenly."""
    if pipeline_size == 1:
        raise ValueError(f"{FIRST_FLAG if first is not None else LAST_FLAG} needs {PP_FLAG} > 1; drop it")
    given = [(flag, value) for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)) if value is not None]
    for flag, value in given:
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
        if value % virtual:
            raise ValueError(f"{flag} {value} is not divisible by the {virtual} virtual stages per rank "
                             f"({VIRTUAL_STAGES_FLAG}); give a multiple of {virtual}")
    others = pipeline_size - len(given)
    remaining = num_layers - sum(value for _, value in given)
    named = " + ".join(f"{flag} {value}" for flag, value in given)
    if others == 0 and remaining:
        raise ValueError(f"{named} must equal --num-layers {num_layers} with {PP_FLAG} {pipeline_size}; "
                         "change one of them")
    if others and remaining < others * virtual:
        raise ValueError(f"{named} leaves {remaining} of --num-layers {num_layers} for the other {others} pipeline "
                         f"rank(s) x {virtual} virtual stage(s), fewer than one layer each; lower {named.split()[0]}")
    if others and remaining % (others * virtual):
        raise ValueError(f"{named} leaves {remaining} of --num-layers {num_layers}, not divisible by the other "
                         f"{others} pipeline rank(s) x {virtual} virtual stage(s) = {others * virtual}; change "
                         f"{named.split()[0]} or --num-layers")
    middle = remaining // others if others else 0
    ranks = [middle] * pipeline_size
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return ranks


def stage_layer_counts(num_layers: int, pipeline_size: int, virtual_size: Optional[int] = None,
                       first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None,
                       account_for_embedding: bool = False, account_for_loss: bool = False) -> List[int]:
    """Transformer layers of every virtual stage `s = vp_stage * pipeline_size + pipeline_rank`.

    `virtual_size` None or 1: one chunk per rank. `first_stage_layers` / `last_stage_layers`: the
    total of the first / last rank (over its chunks). `account_for_embedding` / `account_for_loss`:
    the embedding / loss counts as a layer of the first / last virtual stage. Raises ValueError
    naming the flag and the fix.
    """
    virtual = _check_sizes(num_layers, pipeline_size, virtual_size)
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven and (account_for_embedding or account_for_loss):
        accounted = EMBEDDING_FLAG if account_for_embedding else LOSS_FLAG
        raise ValueError(f"{accounted} cannot be combined with {FIRST_FLAG} / {LAST_FLAG}; drop {accounted} or "
                         "the first/last stage layers")
    if uneven:
        ranks = _uneven_rank_layers(num_layers, pipeline_size, virtual, first_stage_layers, last_stage_layers)
    else:
        extra = int(account_for_embedding) + int(account_for_loss)
        ranks = _even_rank_layers(num_layers, pipeline_size, virtual, extra)
    counts = [ranks[rank] // virtual for _ in range(virtual) for rank in range(pipeline_size)]
    if account_for_embedding:
        counts[0] -= 1
    if account_for_loss:
        counts[-1] -= 1
    for stage, count in enumerate(counts):
        if count < 1:
            # Only the accounted-for embedding (first stage) or loss (last stage) can take a stage's last layer.
            flags = " and ".join(f for f, on in ((EMBEDDING_FLAG, account_for_embedding and stage == 0),
                                                 (LOSS_FLAG, account_for_loss and stage == len(counts) - 1)) if on)
            raise ValueError(f"{flags} leaves virtual stage {stage} (pipeline rank {stage % pipeline_size}, chunk "
                             f"{stage // pipeline_size}) no transformer layer with --num-layers {num_layers}; "
                             f"raise --num-layers or drop {flags}")
    return counts


def stage_layer_range(counts: List[int], pipeline_size: int, pipeline_rank: int, vp_stage: int = 0) -> Tuple[int, int]:
    """Global `[start, end)` layer numbers of chunk `vp_stage` of `pipeline_rank`, in the layout of `counts`."""
    if len(counts) % pipeline_size:
        raise ValueError(f"{len(counts)} virtual stages do not fit {PP_FLAG} {pipeline_size}")
    if not 0 <= pipeline_rank < pipeline_size or not 0 <= vp_stage < len(counts) // pipeline_size:
        raise ValueError(f"pipeline rank {pipeline_rank}, chunk {vp_stage} is outside {pipeline_size} ranks x "
                         f"{len(counts) // pipeline_size} chunks")
    stage = vp_stage * pipeline_size + pipeline_rank
    start = sum(counts[:stage])
    return start, start + counts[stage]


def virtual_size_from_flags(num_layers: int, pipeline_size: int, num_layers_per_virtual_stage: Optional[int],
                            num_virtual_stages_per_rank: Optional[int]) -> Optional[int]:
    """Virtual stages per rank from Megatron's two flags; None without interleaving (a result of 1).

    `num_layers`: what the split divides, so (as Megatron does) the layers plus one for the
    embedding and one for the loss when those are accounted for.
    """
    if num_layers_per_virtual_stage is not None and num_virtual_stages_per_rank is not None:
        raise ValueError(f"give only one of {LAYERS_PER_VIRTUAL_FLAG} and {VIRTUAL_STAGES_FLAG}")
    if num_layers_per_virtual_stage is None and num_virtual_stages_per_rank is None:
        return None
    flag, value = ((LAYERS_PER_VIRTUAL_FLAG, num_layers_per_virtual_stage) if num_layers_per_virtual_stage is not None
                   else (VIRTUAL_STAGES_FLAG, num_virtual_stages_per_rank))
    if value < 1:
        raise ValueError(f"{flag} {value} must be >= 1")
    if pipeline_size == 1:
        raise ValueError(f"{flag} needs {PP_FLAG} > 1; drop {flag} or raise {PP_FLAG}")
    virtual = num_virtual_stages_per_rank
    if num_layers_per_virtual_stage is not None:
        per_round = pipeline_size * num_layers_per_virtual_stage
        if num_layers % per_round:
            raise ValueError(f"{num_layers} layers (--num-layers, plus one each for an accounted-for embedding and "
                             f"loss) are not divisible by {PP_FLAG} {pipeline_size} x {flag} {value} = {per_round}; "
                             "change one of them")
        virtual = num_layers // per_round
    return virtual if virtual > 1 else None
