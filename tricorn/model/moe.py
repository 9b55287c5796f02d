"""Mixture-of-experts MLP: a router picks top-k experts per token; expert FFNs run as one grouped GEMM.

    x [b, s, h] -> tokens [T, h] -> router -> (probs [T, k], experts [T, k])
      -> (optional) capacity dropping -> sort token copies by expert -> expert FFNs -> weight by prob
      -> scatter-add back to [T, h] (+ shared expert) -> [b, s, h]

Routers (Megatron's --moe-router-score-function):
- softmax: scores = softmax(logits); the top-k scores renormalised to sum to one (Mixtral's and
  Megatron's softmax over the top-k logits is the same number; with k = 1 the weight is 1).
- sigmoid: scores = sigmoid(logits); with --moe-router-enable-expert-bias the top-k is chosen on
  scores + a per-expert bias (DeepSeek-V3's aux-loss-free balancing; the bias has no gradient and no
  optimizer state: `update_expert_bias` nudges it after each step towards the mean load), weights are the chosen
  scores, normalised to sum to one when k > 1.

Load balancing (--moe-aux-loss-coeff c, Switch/Megatron "aux_loss"): per microbatch and layer
    aux = c * E / (T^2 k) * sum_e (tokens routed to e) * (sum over tokens of the score of e),
computed over the T tokens of the microbatch. Under sequence parallelism (spec.sequence_shards TP ranks each
route a sequence shard) the counts are summed over the shards (spec.sequence_sum: the microbatch's) and each
rank's loss is its shard's term of the sum (the scores summed over its own tokens; T the whole microbatch's),
so the terms and their gradients add up to the single-process ones. It is not added to the returned
value: `AuxLossScaler` attaches it to the layer's output so that backward adds its gradient, scaled
by the weight the training step sets with `set_aux_loss_scale` (the microbatch's share of the batch
times the loss scale), exactly like Megatron's MoEAuxLossAutoScaler.

Capacity (--moe-expert-capacity-factor f; dropless when unset): each expert takes at most
    capacity = ceil(T * k / E * f)
token copies of the microbatch; with --moe-token-drop-policy probs it keeps its `capacity` copies of
highest routing probability (ties: earlier token first), with position the first `capacity` copies in
token order (under SP: per rank, T its shard's tokens - Megatron's rule). A dropped copy contributes nothing (its probability is not redistributed), so a token
whose k copies are all dropped passes through on the residual only.

Experts hold their weights stacked, w1 [E, ffn (x2 for SwiGLU, gate/up interleaved), h] and
w2 [E, h, ffn]; an expert-parallel split keeps a contiguous range of experts (a ShardInfo on dim 0),
and each expert is initialised and checkpointed under a global name of its own (...experts.<e>.w1:
init.expert_name), so values and checkpoints are the same at any split. The expert GEMMs run through
torch's grouped matmul where it has a fast kernel (CUDA, bf16, compute capability 9.x/10.x, 16-byte aligned rows:
`grouped_mm_fast`) and as one GEMM per expert into one output otherwise (`_LoopGemm`).

Host reads: the loop of GEMMs and a capacity that drops copies need the per-expert copy counts on the host
(their shapes depend on the routing): one read per MoE layer and microbatch (`read_counts`); dropless routing
through the grouped matmul reads nothing. Under `balanced_routing` (tricorn simulate, whose FakeTensors hold
no values) every count reads as the balanced share, T*k/E copies per expert (at most the capacity).

Expert tensor parallelism (spec.expert_tensor_parallel = (TP rank, TP)): each expert holds its slice of w1's rows
(whole gate/up pairs) and of w2's columns (EXPERT_TP_ATTR, init and checkpoints by global name as above); the
spec's `expert_tp_enter` gives every TP rank the same tokens (and under SP the gathered routing of the shards:
`_tp_routing`) and `expert_tp_exit` sums the partial outputs over TP. The router is unchanged.

No collectives; `dispatch` is a hook a parallel implementation replaces (expert parallelism), `weight_grad` (the
spec's) one that may defer the loop of GEMMs' weight gradients to a zero-bubble W (tricorn/parallel/wgrad.py), and
`sequence_sum` another (the TP all-reduce under SP; routers and experts then carry `sequence_parallel`, so the
trainer sums their gradients over TP like the norm weights').
Memory: the sorted token copies and their FFN intermediates, T*k rows instead of T.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tricorn.config import ModelConfig
from tricorn.model.init import EXPERT_ATTR, EXPERT_TP_ATTR, SHARD_ATTR, ShardInfo
from tricorn.model.lean import WeightGrad, eager_hook, swiglu
from tricorn.model.spec import LayerSpec

# The weight of the aux-loss gradient (Megatron: MoEAuxLossAutoScaler.main_loss_backward_scale).
_AUX_SCALE: list[torch.Tensor] = [torch.ones(())]
STATS_EXTRA = 3  # after the per-expert token counts in Router.stats: dropped copies, aux loss sum, forwards
_BALANCED = [False]  # inside `balanced_routing`


@contextmanager
def balanced_routing() -> Iterator[None]:
    """Inside: every host read of copy counts returns the balanced share (tricorn simulate: no routing values exist)."""
    _BALANCED[0] = True
    try:
        yield
    finally:
        _BALANCED[0] = False


def _filled(shape: tuple[int, ...], value: Any) -> Any:
    """Nested lists of `shape` holding `value` (a list stands for the whole last dimension)."""
    if isinstance(value, list) and len(shape) == 1:
        return list(value)
    return [_filled(shape[1:], value) for _ in range(shape[0])] if shape else value


def read_counts(counts: torch.Tensor, balanced: Any) -> Any:
    """`counts` (copy counts, any shape) on the host in one read; in balanced_routing each entry is `balanced`
    (an int, or a list giving the last dimension)."""
    return _filled(tuple(counts.shape), balanced) if _BALANCED[0] else counts.tolist()


def bincount(flat: torch.Tensor, n: int) -> torch.Tensor:
    """torch.bincount with a fixed length n (its output shape does not depend on the values: FakeTensors run it)."""
    return torch.zeros(n, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def set_aux_loss_scale(scale: torch.Tensor) -> None:
    """Weight of every aux loss in the next backward: the microbatch's share of the loss times the loss scale."""
    _AUX_SCALE[0] = scale.detach()


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; in backward also sends grad `scale` into `aux_loss`."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = _AUX_SCALE[0].to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale


def in_backward() -> bool:
    """True while autograd runs a backward (a recomputed forward must not count its tokens twice)."""
    return torch._C._current_graph_task_id() != -1


def capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Token copies one expert may take from a microbatch of `num_tokens` tokens (see module docstring)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


@dataclass
class Routing:
    probs: torch.Tensor  # [T, k] weight of each chosen expert (0 where the copy was dropped)
    experts: torch.Tensor  # [T, k] chosen expert ids
    kept: torch.Tensor  # [T, k] bool, False where capacity dropped the copy
    aux_loss: torch.Tensor  # scalar (zero without --moe-aux-loss-coeff)
    tokens_per_expert: torch.Tensor  # [E] routed copies before dropping
    dropless: bool  # every copy kept (no capacity factor)
    balanced: int  # kept copies per expert if the routing were balanced: min(T*k // E, capacity)


class Router(nn.Module):
    """`shards` ranks each route a shard of the microbatch's tokens (sequence parallelism); `sequence_sum` sums a
    tensor over them (collective-free model: the spec provides it)."""

    def __init__(self, cfg: ModelConfig, shards: int = 1, sequence_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        super().__init__()
        self.shards, self.sequence_sum = shards, sequence_sum
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.score_function = cfg.moe_router_score_function
        self.aux_coeff = cfg.moe_aux_loss_coeff
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.drop_policy = cfg.moe_token_drop_policy
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Moved by update_expert_bias, never by the optimizer (no grad), kept in fp32 at any --bf16/--fp16;
        # a parameter so that checkpoints save it under its global name like the weights.
        bias = torch.zeros(cfg.num_experts, dtype=torch.float32)
        self.expert_bias = nn.Parameter(bias, requires_grad=False) if cfg.moe_router_enable_expert_bias else None
        # Since the last read (training forwards only): copies routed to each expert [E], dropped copies,
        # summed aux loss, forwards (microbatches). One buffer, so a trainer reduces it in one collective.
        self.register_buffer("stats", torch.zeros(cfg.num_experts + STATS_EXTRA, dtype=torch.float32), persistent=False)

    def reset_buffers(self, device: Optional[torch.device]) -> None:
        """The statistics buffer, zeroed on `device` (a model built on meta rebuilds it here: model/init.py)."""
        self.stats = torch.zeros(self.num_experts + STATS_EXTRA, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> Routing:
        x = x.to(torch.promote_types(x.dtype, torch.float32))  # routing in fp32 (float64 stays float64)
        logits = F.linear(x, self.weight.to(x.dtype))
        if self.score_function == "softmax":
            scores = logits.softmax(-1)
            probs, experts = scores.topk(self.topk, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.dtype)
            experts = choice.topk(self.topk, dim=-1).indices
            probs = scores.gather(-1, experts)
        if self.topk > 1 or self.score_function == "softmax":  # Megatron: sigmoid with k = 1 keeps its score
            probs = probs / probs.sum(-1, keepdim=True)
        counts = bincount(experts.flatten(), self.num_experts)
        kept = self._kept(probs, experts)
        aux = self._aux_loss(scores, counts)
        if self.training and not in_backward():
            with torch.no_grad():
                extra = torch.stack([(~kept).sum().float(), aux.detach().float(), torch.ones_like(aux, dtype=torch.float32)])
                self.stats += torch.cat([counts.float(), extra.to(self.stats.device)])
        tokens = experts.shape[0]
        balanced = tokens * self.topk // self.num_experts
        if self.capacity_factor is not None:
            balanced = min(balanced, capacity(tokens, self.topk, self.num_experts, self.capacity_factor))
        return Routing(probs * kept, experts, kept, aux, counts, self.capacity_factor is None, balanced)

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.aux_coeff == 0.0:
            return scores.new_zeros(())
        if self.score_function == "sigmoid":
            scores = scores / scores.sum(-1, keepdim=True)
        if self.sequence_sum is not None:
            counts = self.sequence_sum(counts)
        # Under SP `counts` cover the whole sequence and `scores` this rank's shard: this rank's term of the
        # single-process sum (its gradient reaches exactly this shard's scores; the terms add up over the shards).
        local = scores.shape[0]
        scale = self.aux_coeff * self.num_experts / ((local * self.shards) ** 2 * self.topk)
        return (scores.sum(0) * counts.to(scores.dtype)).sum() * scale

    def _kept(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] bool: which token copies their expert has room for (all without a capacity factor)."""
        if self.capacity_factor is None:
            return torch.ones_like(experts, dtype=torch.bool)
        tokens = experts.shape[0]
        cap = capacity(tokens, self.topk, self.num_experts, self.capacity_factor)
        flat_e = experts.flatten()
        order = torch.arange(flat_e.numel(), device=flat_e.device)  # token-major, the "position" order
        if self.drop_policy == "probs":
            # Highest probability first; the stable sort keeps earlier tokens first among equals.
            order = torch.sort(probs.flatten().detach(), descending=True, stable=True).indices
        # Rank of each copy among its expert's copies in `order`: group by expert, keeping `order` within.
        by_expert = order[torch.sort(flat_e[order], stable=True).indices]
        counts = bincount(flat_e, self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(flat_e)
        rank[by_expert] = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[by_expert]]
        return (rank < cap).view_as(experts)

    def read_stats(self) -> torch.Tensor:
        """The stats buffer since the last read ([E tokens per expert, dropped, aux sum, forwards]), then zeroed."""
        out = self.stats.clone()
        self.stats.zero_()
        return out


@torch.no_grad()
def update_expert_bias(router: Router, tokens_per_expert: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3: raise the bias of under-loaded experts and lower over-loaded ones by `rate`.

    `tokens_per_expert` must be the counts of the whole global batch (summed over data-parallel ranks)."""
    if router.expert_bias is None:
        return
    load = tokens_per_expert.to(router.expert_bias)
    router.expert_bias += rate * torch.sign(load.mean() - load)


def grouped_mm_fast(device_type: str, dtype: torch.dtype, capability: tuple[int, int], row_bytes: list[int]) -> bool:
    """Whether torch's grouped matmul has its fast kernel here: CUDA, bf16, compute capability 9.x or 10.x, rows of
    16-byte multiples. torch's CUDA _grouped_mm (aten/src/ATen/native/cuda/GroupedBlas.cpp) runs its CUTLASS
    bf16bf16_grouped_mm only for bf16 inputs and output on a device `_scaled_mm_allowed_device(sm90_only,
    sm100_only)` accepts (major 9 or 10: SM120 is not among them). Anywhere else it falls back to
    `_grouped_mm_fallback`, which copies the offsets to the host (offs.cpu(): a device sync) and loops over the
    experts, so tricorn's own loop (`_LoopGemm`, with one documented read of the counts) is no worse."""
    ok = device_type == "cuda" and dtype == torch.bfloat16 and capability[0] in (9, 10)
    return ok and all(n % 16 == 0 for n in row_bytes)


def _grouped_mm_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    if x.device.type != "cuda" or not hasattr(F, "grouped_mm"):
        return False
    rows = [n * x.element_size() for w in weights for n in (w.shape[-1], w.shape[-2])]
    return grouped_mm_fast(x.device.type, x.dtype, torch.cuda.get_device_capability(x.device), rows)


def _expert_weight_grads(x: torch.Tensor, grad: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's weight gradient g_e^T x_e, written into one stacked [E, out, in] gradient."""
    grad_w = grad.new_empty(len(counts), grad.shape[1], x.shape[1])
    for e, (part, g) in enumerate(zip(x.split(counts), grad.split(counts))):
        torch.mm(g.t(), part, out=grad_w[e])
    return grad_w


class _LoopGemm(torch.autograd.Function):
    """Rows grouped by expert times each expert's weight, one GEMM per expert, written into one output; backward
    writes each expert's weight gradient into one stacked gradient (autograd over a list of GEMMs would hold the
    concatenated parts and a per-expert gradient beside the stack), handed to the `weight_grad` hook when there is
    one (a zero-bubble W may take it: it then keeps x and grad, not the stack)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: list[int], weight_grad: Optional[WeightGrad]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.weight_grad = counts, weight_grad
        if weight_grad is not None:
            ctx.param = weight  # the tensor received (not its saved copy), for the hook
        out = x.new_empty(x.shape[0], weight.shape[1])
        for e, (part, rows) in enumerate(zip(x.split(counts), out.split(counts))):
            torch.mm(part, weight[e].t(), out=rows)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        for e, (g, gx) in enumerate(zip(grad.split(ctx.counts), grad_x.split(ctx.counts))):
            torch.mm(g, weight[e], out=gx)
        grad_w = None
        if ctx.needs_input_grad[1]:
            thunk = functools.partial(_expert_weight_grads, x, grad, ctx.counts)
            grad_w = thunk() if ctx.weight_grad is None else ctx.weight_grad(ctx.param, thunk)
        return grad_x, grad_w, None, None


def expert_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Optional[list[int]],
    ends: Optional[torch.Tensor],
    weight_grad: Optional[WeightGrad] = None,
) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows for expert e) times weight[e].T: [sum counts, out]. The loop's
    weight gradient goes through `weight_grad` (lean.WeightGrad); torch's grouped matmul computes its own."""
    if ends is not None:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    return _LoopGemm.apply(x, weight, counts, eager_hook(weight_grad))


class Experts(nn.Module):
    """E FFNs with stacked weights (no biases: --num-experts needs --disable-bias-linear): [rows by expert, h] -> same."""

    def __init__(self, cfg: ModelConfig, num_local_experts: int, tp: int = 1, weight_grad: Optional[WeightGrad] = None):
        super().__init__()
        self.swiglu, self.weight_grad = cfg.swiglu, weight_grad  # the spec's hook for the loop's weight gradients
        ffn = cfg.moe_ffn_size // tp  # expert tensor parallelism: this rank's w1 rows (whole gate/up pairs), w2 columns
        self.w1 = nn.Parameter(torch.empty(num_local_experts, ffn * (2 if cfg.swiglu else 1), cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, cfg.hidden_size, ffn))

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether the GEMMs of rows like `x` run as torch's grouped matmul (no host counts needed)."""
        return _grouped_mm_ok(x, self.w1, self.w2)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, host: Optional[list[int]] = None) -> torch.Tensor:
        """`counts`: rows per local expert, in order, on the device; `host`: the same on the host, which the loop of
        GEMMs needs (None only when `grouped(x)`)."""
        w1, w2 = self.w1.to(x.dtype), self.w2.to(x.dtype)
        ends = torch.cumsum(counts, 0).to(torch.int32) if self.grouped(x) else None
        h = expert_gemm(x, w1, host, ends, self.weight_grad)  # a cast w1 (another dtype) is no leaf: never deferred
        h = swiglu(h) if self.swiglu else F.gelu(h)  # SwiGLU saves only its input (lean.py), as the dense MLP
        return expert_gemm(h, w2, host, ends, self.weight_grad)


def sort_by_expert(experts: torch.Tensor, kept: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(copy indices ordered by expert, dropped copies last; kept copies per expert [E])."""
    flat_e = torch.where(kept, experts, num_experts).flatten()
    order = torch.sort(flat_e, stable=True).indices
    return order, bincount(flat_e, num_experts + 1)[:num_experts]


def sum_rows(like: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A tensor shaped like `like` whose row i sums the `rows` (times their `weights`) with index i.

    index_put accumulates in index order and keeps only the index for backward (index_add would keep `rows` too).
    """
    if weights is not None:
        rows = rows * weights.unsqueeze(-1).to(rows.dtype)
    return like.new_zeros(like.shape).index_put((index,), rows, accumulate=True)


def local_dispatch(x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    """Each kept token copy through its expert on this process, weighted by its probability and summed per token: [T, h].

    Expert parallelism replaces this with an all_to_all over its group (tricorn.parallel.expert)."""
    order, counts = sort_by_expert(routing.experts, routing.kept, routing.tokens_per_expert.numel())
    host = None
    if not (routing.dropless and experts.grouped(x)):  # dropless grouped GEMMs: T*k rows, grouped on the device
        host = read_counts(counts, routing.balanced)  # the one host read of this layer and microbatch
        order = order[: sum(host)]
    token = order // routing.experts.shape[1]
    return sum_rows(x, token, experts(x[token], counts, host), routing.probs.flatten()[order])


class MoEMLP(nn.Module):
    """Drop-in for the dense MLP: [b, s, h] -> [b, s, h]. With expert parallelism (spec.expert_parallel) this
    rank holds experts [rank * E/ep, (rank + 1) * E/ep) and spec.expert_dispatch reaches the others."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, shared_expert: Optional[nn.Module] = None):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.router = Router(cfg, spec.sequence_shards, spec.sequence_sum)
        ep_rank, ep = spec.expert_parallel
        etp_rank, etp = spec.expert_tensor_parallel
        self.experts = Experts(cfg, cfg.num_experts // ep, etp, spec.weight_grad)
        for dim, w in enumerate((self.experts.w1, self.experts.w2)):  # w1 column-, w2 row-split under expert TP
            setattr(w, SHARD_ATTR, ShardInfo(dim=0, rank=ep_rank, world=ep, full_size=cfg.num_experts))
            setattr(w, EXPERT_ATTR, True)
            if etp > 1:
                setattr(w, EXPERT_TP_ATTR, ShardInfo(dim=dim, rank=etp_rank, world=etp, full_size=w.shape[1 + dim] * etp))
        if spec.sequence_shards > 1:  # replicated over TP, fed a sequence shard: grads.py sums their grads over TP
            for p in (self.router.weight,) if etp > 1 else (self.router.weight, self.experts.w1, self.experts.w2):
                p.sequence_parallel = True  # (expert-TP experts are TP shards that saw every token: no sum)
        self.shared_expert = shared_expert
        self.dispatch = spec.expert_dispatch or local_dispatch
        self.tp_enter, self.tp_exit = spec.expert_tp_enter, spec.expert_tp_exit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, -2)
        routing = self.router(tokens)
        if self.tp_enter is None or self.tp_exit is None:
            out = self.dispatch(tokens, routing, self.experts).view_as(x)
        else:  # expert TP: every TP rank runs the same tokens through its slice of the experts; partial sums reduced
            every = self.tp_enter(x)
            out = self.dispatch(every.flatten(0, -2), self._tp_routing(routing, x), self.experts)
            out = self.tp_exit(out.view_as(every))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.router.aux_coeff and torch.is_grad_enabled():
            out = AuxLossScaler.apply(out, routing.aux_loss)
        return out

    def _tp_routing(self, routing: Routing, x: torch.Tensor) -> Routing:
        """The routing of the tokens `tp_enter` gives every TP rank (under SP each rank routed its own shard: the
        shards' weights and choices are gathered like the hidden states; the weights' gradients sum back over TP)."""
        lead, k = x.shape[:-1], routing.experts.shape[1]
        probs = self.tp_enter(routing.probs.view(*lead, k)).flatten(0, -2)
        choice = self.tp_enter(torch.cat([routing.experts, routing.kept.long()], -1).view(*lead, 2 * k)).flatten(0, -2)
        shards = probs.shape[0] // routing.probs.shape[0]
        return dataclasses.replace(
            routing, probs=probs, experts=choice[:, :k], kept=choice[:, k:].bool(), balanced=routing.balanced * shards
        )
