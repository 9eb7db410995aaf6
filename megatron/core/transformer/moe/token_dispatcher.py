"""Token dispatch: routed tokens to the ranks holding their experts, and the outputs back.

The experts of a layer live on the expert grid's `ep x etp` ranks (`group`; group rank
g = etp_rank + etp * ep_rank, the expert grid's order). Expert e sits on ep rank e // E_local,
split over that rank's etp peers, which all need its tokens and each return a partial sum.
Every rank routes its own tokens (sequence-parallel and context-parallel shares, data-parallel
replicas' micro-batches), so the group's ranks hold different tokens.

- `AllToAllDispatcher` (`--moe-token-dispatcher-type alltoall`): assignments sorted by expert,
  per-expert counts exchanged first (one small all-to-all, then the one host sync of a layer: the
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

from typing import List

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import group_size
from megatron.core.transformer.moe.experts import GroupedExperts
from megatron.core.transformer.moe.router import Routing


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


class Assignments:
    """Every (token, expert) pair of a micro-batch in expert-major order (by expert, then token),
    with the counts per expert (on the device) and the way back to one output per token.

    Dropless token choice (`Routing.top_indices`): a stable sort of the T*k expert ids gives the
    order without a host sync, and the combine sums each token's k outputs (deterministic, no
    atomics). Otherwise the pairs come from the routing map and outputs are summed per token by
    `index_add`."""

    def __init__(self, routing: Routing, num_experts: int) -> None:
        self.num_tokens = routing.routing_map.shape[0]
        if routing.top_indices is not None:
            self.k = routing.top_indices.shape[1]
            flat = routing.top_indices.reshape(-1)
            self.order = torch.argsort(flat, stable=True)  # expert-major position -> token-major one
            self.expert_index, self.token_index = flat[self.order], self.order // self.k
            self.top_probs = routing.top_probs
        else:
            self.order = None
            self.expert_index, self.token_index = routing.routing_map.t().nonzero(as_tuple=True)
            self.weights = routing.probs[self.token_index, self.expert_index]
        self.counts = expert_counts(self.expert_index, num_experts)

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """`outputs [A, h]` in expert-major order -> each token's probability-weighted sum `[T, h]`."""
        if self.order is None:
            weighted = outputs.float() * self.weights.unsqueeze(-1)
            combined = weighted.new_zeros((self.num_tokens, outputs.shape[-1]))
            return combined.index_add(0, self.token_index, weighted).to(outputs.dtype)
        per_token = outputs[inverse_permutation(self.order)].view(self.num_tokens, self.k, -1)
        weights = self.top_probs.to(per_token.dtype).unsqueeze(1)  # [T, 1, k]
        return torch.bmm(weights, per_token).squeeze(1)


def expert_counts(expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, on the device (a scatter-add: bincount would read the max back)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_index.device)
    return counts.scatter_add_(0, expert_index, torch.ones_like(expert_index))


def run_sorted(experts: GroupedExperts, tokens: torch.Tensor, local_expert: torch.Tensor,
               num_local_experts: int) -> torch.Tensor:
    """The experts' outputs for `tokens` in their given order, each row by `local_expert[row]`."""
    order = torch.argsort(local_expert, stable=True)
    output = experts(tokens[order], expert_counts(local_expert, num_local_experts))
    return output[inverse_permutation(order)]


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`inverse` with `inverse[order[i]] = i` (a scatter, no second sort)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class AllToAllDispatcher:
    def __init__(self, group, ep_size: int, etp_size: int, num_experts: int) -> None:
        self.group, self.ep, self.etp = group, ep_size, etp_size
        self.ranks = group_size(group)
        self.num_experts, self.num_local = num_experts, num_experts // ep_size

    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        assignments = Assignments(routing, self.num_experts)
        routed = tokens[assignments.token_index]
        if self.ranks == 1:  # already sorted by expert
            outputs = experts(routed, assignments.counts)
        else:
            outputs = self._exchange(routed, assignments.counts, experts)
        return assignments.combine(outputs)

    def _exchange(self, routed: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        counts = counts.view(self.ep, self.num_local)
        send_counts = counts.repeat_interleave(self.etp, dim=0)  # [group rank, local expert]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # The one host sync of the layer: the split sizes of both exchanges.
        host = torch.cat([send_counts.sum(1), recv_counts.sum(1), counts.sum(1)]).tolist()
        sent, received = host[:self.ranks], host[self.ranks:2 * self.ranks]
        per_ep_rank = routed.split(host[2 * self.ranks:])
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
    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        if self.ranks == 1:
            return super().__call__(tokens, routing, experts)
        probs, routing_map = routing.dense_probs(), routing.routing_map
        sizes = self._token_counts(tokens.shape[0], tokens.device)
        mine = [tokens.shape[0]] * self.ranks
        # An all-gather of rows of different lengths, as an all-to-all sending every rank the same rows.
        gathered = [all_to_all_v(t.repeat(self.ranks, 1), sizes, mine, self.group)
                    for t in (tokens, probs, routing_map.to(torch.uint8))]
        all_tokens, all_probs, all_map = gathered[0], gathered[1], gathered[2].bool()
        first = experts.first_expert
        local = all_map[:, first:first + self.num_local]
        assignments = Assignments(Routing(local, probs=all_probs[:, first:first + self.num_local]), self.num_local)
        partial = assignments.combine(experts(all_tokens[assignments.token_index], assignments.counts))
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
