"""Mixture of experts across ranks: expert parallelism (EP), router statistics, the expert-bias update.

Expert parallelism (--expert-model-parallel-size EP). The ep group is EP ranks of DP x CP (state.py);
each holds E/EP consecutive experts and its own tokens. `ep_dispatch` replaces moe.py's local
dispatch (through the layer spec, so the model stays collective-free). A token goes to each rank
that holds one of its experts once, however many of its k experts sit there:

  1. per (token, rank) pair with a kept copy there, one row: the token's hidden state, and its
     routing weights for that rank's E/EP experts (-1 where the token is not routed);
  2. one small all_to_all of the [EP, E/EP + 1] counts (rows, copies per local expert), read on
     the host with this rank's own counts in one read: they size the splits and the expert GEMMs;
  3. all_to_all (variable split sizes) of the rows and of their weights to the experts' ranks;
  4. each arrived row through each of its local experts (grouped by local expert), weighted and
     summed per row;
  5. all_to_all of one row per arrived row back (the reverse splits), summed per token.

Backward runs the three transfers in reverse (autograd). Volume per layer and microbatch, in
elements sent to other ranks: 2 x rows x h forward (dispatch, combine) and the same backward - the
least any scheme moves, since a row leaves for another rank only if one of its experts is there -
plus the routing weights, E/EP fp32 per row each way, and the counts. Memory: the arrived rows, their
copies and the experts' intermediates (on average as many copies as the rank's own T x k). The
experts' gradients sum over the expert-DP group only (data_parallel.py, grads.py); checkpoints hold
each expert under its own global name (tricorn/checkpoint/pieces.py), so they reshard to any EP.

Sequence parallelism: each TP rank dispatches its own sequence shard over its ep group (the groups of
different TP ranks hold the same experts); nothing here is gathered over TP.

Expert tensor parallelism (--expert-tensor-parallel-size ETP, 1 or TP; Megatron's default is TP, tricorn's 1).
With ETP = TP each routed expert's w1 (gate|up) is column-split and w2 row-split over the TP group, as the dense
MLP, and Megatron's token flow applies: every TP rank of a group runs the same tokens through its slices. The
router runs as without ETP (under SP on each rank's sequence shard); `apply_expert_tensor_parallel` gives the
layer two hooks around the dispatch: without SP the tokens are already the same on every TP rank (the hook marks
the fan-out: backward all-reduces the tokens' and the routing weights' gradients over TP) and the experts' partial
outputs are all-reduced over TP; under SP the shards' tokens and routing are all-gathered over TP (backward
reduce-scatter) and the partial outputs reduce-scattered back to the shards. The ep dispatch runs unchanged over
the ep group of ranks with the same TP rank, which hold the same slices. Expert gradients are TP shards (not
summed over TP), reduced over expert-DP = DP x CP / EP as before (Megatron: world / (PP x EP x ETP)). Cost:
per MoE layer and microbatch two more TP collectives of the hidden states (all-reduce, or all-gather plus
reduce-scatter), each rank's all_to_alls move the TP group's tokens (TP times the ETP=1 volume under SP) and
its experts see them; expert weights, gradients and optimizer state / TP.

Router statistics: `MoEMonitor` turns the routers' device-side counters into global numbers (under SP
first summed over TP after each step, one all_reduce of the same tensor: each TP rank counted its shard). With
the expert bias, after every optimizer step one all_reduce (sum) over DP x CP of a [MoE layers, E + 3]
tensor gives the counts of the whole global batch, and DeepSeek-V3's bias moves by them on every rank
alike (on the device: a skipped step moves nothing, and nothing is read on the host). At a log line
the counters are summed over DP x CP (without the bias) and PP and handed to the trainer's one host
read; the values (mean aux loss per microbatch and layer, copies routed per expert per iteration,
dropped copies per iteration) go to TensorBoard and the metrics file. Memory: layers x (E + 3) floats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config
from tricorn.model.moe import Experts, Router, Routing, bincount, read_counts, sum_rows, update_expert_bias
from tricorn.model.spec import LayerSpec
from tricorn.parallel.tensor import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


# bench/comm_volume.py sets a dict here: every dispatch then adds the least number of hidden-state bytes any
# scheme must send for this rank's tokens in one direction ("minimum": each token once per other rank holding
# one of its experts, from the routing); dispatch and combine, forward and backward, move it four times.
A2A_COUNTER: list[Optional[dict]] = [None]


def _rows_by_rank(has: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, rank) of the first `count` True entries of `has` [T, ranks], ordered by rank, then token."""
    tokens = has.shape[0]
    key = torch.where(has.t(), torch.arange(has.shape[1], device=has.device)[:, None], has.shape[1]).flatten()
    order = torch.sort(key, stable=True).indices[:count]
    return order % tokens, order // tokens


def _copies_by_expert(weights: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, local expert, copies per local expert) of the first `count` routed slots of `weights` [rows, local]
    (routed: >= 0), ordered by local expert, then row."""
    local = weights.shape[1]
    key = torch.where(weights >= 0, torch.arange(local, device=weights.device), local).flatten()
    order = torch.sort(key, stable=True).indices[:count]
    return order // local, order % local, bincount(key, local + 1)[:local]


def ep_dispatch(group, ep_rank: int, ep: int):
    """The layer spec's expert_dispatch for this rank of the ep `group` (see the module docstring)."""

    def dispatch(x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        tokens, k = routing.experts.shape
        local = routing.tokens_per_expert.numel() // ep
        # [T, EP, E/EP] routing weights, -1 where a token has no kept copy (a token's k experts are distinct).
        slot = torch.arange(tokens, device=x.device)[:, None] * (ep * local) + routing.experts
        weights = torch.full((tokens * ep * local,), -1.0, dtype=routing.probs.dtype, device=x.device)
        weights = weights.scatter(0, slot.flatten(), torch.where(routing.kept, routing.probs, -1.0).flatten())
        weights = weights.view(tokens, ep, local)
        has = (weights >= 0).any(-1)  # [T, EP]: a row goes to that rank
        copies = bincount(torch.where(routing.kept, routing.experts, ep * local).flatten(), ep * local + 1)[:-1]
        send = torch.cat([has.sum(0)[:, None], copies.view(ep, local)], 1)  # [EP, 1 + E/EP]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        balanced = [min(tokens, routing.balanced * local)] + [routing.balanced] * local  # tricorn simulate
        host_send, host_recv = read_counts(torch.stack([send, recv]), balanced)  # the one host read
        send_rows, recv_rows = [r[0] for r in host_send], [r[0] for r in host_recv]
        token, rank = _rows_by_rank(has, sum(send_rows))
        if A2A_COUNTER[0] is not None:  # tokens x other ranks holding one of their experts (a host read: bench only)
            A2A_COUNTER[0]["minimum"] += int(has.sum() - has[:, ep_rank].sum()) * x.shape[-1] * x.element_size()
        rows = _AllToAll.apply(x[token], recv_rows, send_rows, group)
        row_weights = _AllToAll.apply(weights[token, rank], recv_rows, send_rows, group)
        per_expert = [sum(r[1 + j] for r in host_recv) for j in range(local)]
        row, expert, counts = _copies_by_expert(row_weights, sum(per_expert))
        y = sum_rows(rows, row, experts(rows[row], counts, per_expert), row_weights[row, expert])
        return sum_rows(x, token, _AllToAll.apply(y, send_rows, recv_rows, group))

    return dispatch


def apply_expert_tensor_parallel(spec: LayerSpec, cfg: Config, tp_group) -> LayerSpec:
    """With --expert-tensor-parallel-size TP: the spec that splits each routed expert over `tp_group` (see the
    module docstring); unchanged at ETP 1 (validation allows only 1 and TP)."""
    tp = dist.get_world_size(tp_group)
    if cfg.parallel.expert_tensor_parallel_size == 1 or tp == 1:
        return spec
    if spec.sequence_shards > 1:  # SP: the sequence shards in, the summed outputs back to the shards
        enter, leave = gather_from_sequence, reduce_scatter_to_sequence
    else:  # the same tokens on every TP rank already: mark the fan-out (backward all-reduce), sum the outputs
        enter, leave = copy_to_tp, reduce_from_tp
    return dataclasses.replace(
        spec,
        expert_tensor_parallel=(dist.get_rank(tp_group), tp),
        expert_tp_enter=lambda t: enter(t, tp_group),
        expert_tp_exit=lambda t: leave(t, tp_group),
    )


def apply_expert_parallel(spec: LayerSpec, ep_group) -> LayerSpec:
    """The spec with this rank's share of the experts and the all_to_all dispatch; unchanged without EP."""
    if ep_group is None:
        return spec
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    return dataclasses.replace(spec, expert_parallel=(rank, ep), expert_dispatch=ep_dispatch(ep_group, rank, ep))


class MoEMonitor:
    """The routers' statistics of this rank's chunks: expert-bias updates and the logged MoE values."""

    def __init__(self, cfg: Config, chunks: Sequence[nn.Module], dp_cp_group, pp_group, device: torch.device, sp_group=None):
        m = cfg.model
        self.num_experts = m.num_experts
        self.moe_layers = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
        self.bias_rate = m.moe_router_bias_update_rate if m.moe_router_enable_expert_bias else 0.0
        # Under sequence parallelism each TP rank routes one sequence shard (model/moe.py): `sp_group` (TP) sums
        # its counts, dropped copies and aux-loss terms into the microbatch's; every TP rank counted the forward.
        self.dp_cp_group, self.pp_group, self.sp_group = dp_cp_group, pp_group, sp_group
        self.shards = dist.get_world_size(sp_group) if sp_group is not None else 1
        self.routers: dict[int, Router] = {}
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, Router):
                    self.routers[int(name.split("layers.")[1].split(".")[0])] = module
        self.pending = torch.zeros(len(self.moe_layers), self.num_experts + 3, device=device)
        self.iterations = 0

    @classmethod
    def for_model(cls, cfg: Config, chunks: Sequence[nn.Module], state) -> Optional[MoEMonitor]:
        if cfg.model.num_experts is None:
            return None
        sp = cfg.parallel.sequence_parallel and state.tp_size > 1
        return cls(cfg, chunks, state.dp_cp_group, state.pp_group, state.device, state.tp_group if sp else None)

    def _read_routers(self) -> torch.Tensor:
        stats = torch.zeros_like(self.pending)
        for row, layer in enumerate(self.moe_layers):
            if layer in self.routers:
                stats[row] = self.routers[layer].read_stats()
        if self.sp_group is not None:  # the shards' statistics into the whole microbatch's (one all_reduce per step)
            dist.all_reduce(stats, group=self.sp_group)
            stats[:, -1] /= self.shards  # each of the TP ranks counted every forward
        return stats

    def after_step(self, skipped: Union[torch.Tensor, bool]) -> None:
        """Collect this step's router statistics; with the expert bias, sum them over DP x CP and move the biases
        (by nothing when the step was skipped: `skipped` stays on the device)."""
        self.iterations += 1
        if not self.bias_rate:  # nothing needs the global counts before the log line
            self.pending += self._read_routers()
            return
        stats = self._read_routers()
        dist.all_reduce(stats, group=self.dp_cp_group)
        # A Python bool (no loss scaler) stays a number: as a tensor it would be a host-to-device copy on CUDA.
        rate = self.bias_rate * (1.0 - skipped.float()) if isinstance(skipped, torch.Tensor) else self.bias_rate * (not skipped)
        for row, layer in enumerate(self.moe_layers):
            if layer in self.routers:
                update_expert_bias(self.routers[layer], stats[row, : self.num_experts], rate)
        self.pending += stats

    def collect(self) -> torch.Tensor:
        """The statistics since the last call, summed over DP x CP and PP, on the device (collectives: every rank
        calls it at a log line); `values` turns its host copy into the logged numbers."""
        stats, self.pending = self.pending, torch.zeros_like(self.pending)
        if not self.bias_rate:  # otherwise already summed over DP x CP step by step
            dist.all_reduce(stats, group=self.dp_cp_group)
        dist.all_reduce(stats, group=self.pp_group)  # each stage filled only its own layers
        return stats

    def values(self, flat: list[float]) -> dict[str, float]:
        """The logged values from `collect`'s tensor (read on the host, flattened) over the iterations since the last log."""
        iters, self.iterations = max(self.iterations, 1), 0
        e = self.num_experts
        rows = [flat[i : i + e + 3] for i in range(0, len(flat), e + 3)]
        forwards = sum(r[e + 2] for r in rows)
        values = {
            "moe/aux-loss": sum(r[e + 1] for r in rows) / max(forwards, 1.0),
            "moe/dropped-tokens": sum(r[e] for r in rows) / iters,
        }
        for layer, r in zip(self.moe_layers, rows):
            for expert in range(e):
                values[f"moe/layer-{layer}/tokens-expert-{expert}"] = r[expert] / iters
        return values
