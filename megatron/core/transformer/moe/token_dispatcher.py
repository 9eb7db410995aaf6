"""Token dispatch: routed tokens to the ranks holding their experts, and the outputs back.

The experts of a layer live on the expert grid's `ep x etp` ranks (`group`; group rank
g = etp_rank + etp * ep_rank, the expert grid's order). Expert e sits on ep rank e // E_local,
split over that rank's etp peers, which all need its tokens and each return a partial sum.
Every rank routes its own tokens (sequence-parallel and context-parallel shares, data-parallel
replicas' micro-batches), so the group's ranks hold different tokens.

- `AllToAllDispatcher` (`--moe-token-dispatcher-type alltoall`): assignments sorted by expert,
  per-expert counts exchanged first (one small all-to-all and the one host sync of a layer: the
  split sizes), then each token goes once to every etp rank of its expert's ep rank, is
  re-sorted there by local expert, runs through the grouped GEMM, and comes back the same way;
  the etp partial sums are added at the source.
- `AllGatherDispatcher` (`allgather`): every rank of the group gathers all the group's tokens,
  probabilities and routing maps, runs its local experts on the assignments it holds, and the
  partial outputs are summed back to the tokens' ranks. More traffic for large groups, no
  per-expert bookkeeping; ranks may hold different numbers of tokens (variable-length
  micro-batches differ between data-parallel replicas).

Both multiply each assignment's output by its routing probability and sum a token's
assignments; with one rank in the group no communication happens at all. Both are
differentiable end to end (the collectives' backward is the reverse exchange).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import group_size
from megatron.core.transformer.moe.experts import GroupedExperts


def _all_to_all(tensor: torch.Tensor, output_splits: List[int], input_splits: List[int], group) -> torch.Tensor:
    output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits, group=group)
    return output


class _AllToAllV(torch.autograd.Function):
    """Rows `input_splits[g]` to group rank g; receives `output_splits[g]` rows from rank g."""

    @staticmethod
    def forward(ctx, tensor, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(tensor, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all_v(tensor: torch.Tensor, output_splits: List[int], input_splits: List[int], group) -> torch.Tensor:
    return _AllToAllV.apply(tensor, output_splits, input_splits, group)


def expert_major(routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(expert index, token index) of every assignment, sorted by expert, then token."""
    expert_index, token_index = routing_map.t().nonzero(as_tuple=True)
    return expert_index, token_index


def run_sorted(experts: GroupedExperts, tokens: torch.Tensor, local_expert: torch.Tensor,
               num_local_experts: int) -> torch.Tensor:
    """The experts' outputs for `tokens` in their given order, each row by `local_expert[row]`."""
    order = torch.argsort(local_expert, stable=True)
    counts = torch.bincount(local_expert, minlength=num_local_experts).tolist()
    output = experts(tokens[order], counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return output[inverse]


def combine(num_tokens: int, token_index: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its assignments' outputs times their routing probabilities."""
    weighted = outputs.float() * weights.unsqueeze(-1)
    combined = weighted.new_zeros((num_tokens, outputs.shape[-1]))
    return combined.index_add(0, token_index, weighted).to(outputs.dtype)


class AllToAllDispatcher:
    def __init__(self, group, ep_size: int, etp_size: int, num_experts: int) -> None:
        self.group, self.ep, self.etp = group, ep_size, etp_size
        self.ranks = group_size(group)
        self.num_experts, self.num_local = num_experts, num_experts // ep_size

    def __call__(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        expert_index, token_index = expert_major(routing_map)
        routed = tokens[token_index]
        if self.ranks == 1:
            outputs = run_sorted(experts, routed, expert_index, self.num_local)
        else:
            outputs = self._exchange(routed, expert_index, experts)
        return combine(tokens.shape[0], token_index, outputs, probs[token_index, expert_index])

    def _exchange(self, routed: torch.Tensor, expert_index: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        counts = torch.bincount(expert_index, minlength=self.num_experts).view(self.ep, self.num_local)
        send_counts = counts.repeat_interleave(self.etp, dim=0)  # [group rank, local expert]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sent, received = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        per_ep_rank = routed.split(counts.sum(1).tolist())
        send = torch.cat([per_ep_rank[rank // self.etp] for rank in range(self.ranks)])
        arrived = all_to_all_v(send, received, sent, self.group)
        local_expert = torch.repeat_interleave(
            torch.arange(self.num_local, device=routed.device).repeat(self.ranks), recv_counts.flatten(),
            output_size=sum(received))
        outputs = run_sorted(experts, arrived, local_expert, self.num_local)
        back = all_to_all_v(outputs, sent, received, self.group).split(sent)
        if self.etp == 1:
            return torch.cat(back)
        # The etp ranks of one ep rank returned partial sums of the same rows: add them up.
        return torch.cat([sum(back[p * self.etp:(p + 1) * self.etp]) for p in range(self.ep)])


class AllGatherDispatcher(AllToAllDispatcher):
    def __call__(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        if self.ranks == 1:
            return super().__call__(tokens, probs, routing_map, experts)
        sizes = self._token_counts(tokens.shape[0], tokens.device)
        mine = [tokens.shape[0]] * self.ranks
        # An all-gather of rows of different lengths, as an all-to-all sending every rank the same rows.
        gathered = [all_to_all_v(t.repeat(self.ranks, 1), sizes, mine, self.group)
                    for t in (tokens, probs, routing_map.to(torch.uint8))]
        all_tokens, all_probs, all_map = gathered[0], gathered[1], gathered[2].bool()
        first = experts.first_expert
        local_index, token_index = expert_major(all_map[:, first:first + self.num_local])
        outputs = run_sorted(experts, all_tokens[token_index], local_index, self.num_local)
        partial = combine(all_tokens.shape[0], token_index, outputs, all_probs[token_index, first + local_index])
        # Every rank's partial outputs of this rank's tokens, summed.
        returned = all_to_all_v(partial, mine, sizes, self.group)
        return returned.view(self.ranks, tokens.shape[0], -1).sum(0)

    def _token_counts(self, count: int, device: torch.device) -> List[int]:
        counts = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(self.ranks)]
        dist.all_gather(counts, torch.tensor([count], dtype=torch.int64, device=device), group=self.group)
        return torch.cat(counts).tolist()


def build_dispatcher(dispatcher_type: str, group, ep_size: int, etp_size: int, num_experts: int):
    cls = AllGatherDispatcher if dispatcher_type == "allgather" else AllToAllDispatcher
    return cls(group, ep_size, etp_size, num_experts)
