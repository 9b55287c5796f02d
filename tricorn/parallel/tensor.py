"""Tensor and sequence parallelism (Megatron-LM style), applied through the layer spec.

Column-parallel linear: each TP rank holds a contiguous slice of the output
rows. Row-parallel linear: a slice of the input columns; partial outputs are
summed. A column/row pair (QKV -> output projection, w1 -> w2) therefore needs
one reduction per direction:

    without SP   forward: identity in, all-reduce out      backward: all-reduce in
    with SP      forward: all-gather(seq) in, reduce-scatter(seq) out
                 backward: reduce-scatter(seq) in, all-gather(seq) out

Sequence parallel keeps the activations between those pairs (norms, dropout,
residual) sharded along the sequence, dividing their memory by TP at no extra
communication volume (all-reduce = reduce-scatter + all-gather). Hidden states
are sequence-first ([s, b, h], model/transformer.py), so a rank's sequence shard
is one contiguous block: the gathers and scatters read and write the tensors
themselves, with no transposing copy, and the TP all-reduces run in place on
tensors nothing else holds (no clone; each one argued at its function). Under SP a
column-parallel linear (and the head) saves its input's sequence SHARD for
backward, not the all-gathered sequence, and all-gathers it again in backward
(asynchronously, overlapped with the input-gradient matmul, whose
reduce-scatter in turn overlaps the weight-gradient matmul), as Megatron does:
one more all-gather per linear in backward for 1/TP of its saved input (eager mode; under --torch-compile
the collectives trace as functional ones and the graph keeps the gathered input: tricorn/parallel/compile.py). Parameters
that are replicated over TP but see only a sequence shard (norm weights, row
biases), or only this rank's heads (--qk-layernorm's per-head norms, SP or not), get partial gradients; they
carry `sequence_parallel = True` and the trainer all-reduces their gradients over TP (grads.py).

The embedding is vocab-parallel (rows split over TP, out-of-range tokens
give zeros, outputs summed), and the loss is a vocab-parallel cross entropy
that reduces three [s, b] tensors (max, target logit, sum of exp) over TP and
never gathers the [s, b, V] logits; it keeps the logits in the compute dtype and
does its fp32 math in chunks (tricorn.model.lean.cross_entropy). Memory: weights
/ TP; logits / TP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tricorn.config import Config
from tricorn.model.init import SHARD_ATTR, ShardInfo, shard_info
from tricorn.model.lean import cross_entropy
from tricorn.model.spec import HeadLinear, LayerSpec, make_norm, masked_cross_entropy
from tricorn.parallel import wgrad

SEQ_DIM = 0  # hidden states are [seq, batch, hidden]


# ---------------------------------------------------------------- collectives along the sequence


def _dim_major(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` with `dim` moved first, contiguous: the tensor itself when its memory is already `dim`-major (the
    decoder's sequence-first states, CP's k and v), a copy otherwise (a caller's [b, heads, s, d] tensor)."""
    return x.movedim(dim, 0).contiguous()


class _Then:
    """An asynchronous collective's work, and a local step to run once it has completed."""

    def __init__(self, work: dist.Work, then: Callable[[], None]):
        self.work, self.then = work, then

    def wait(self) -> None:
        self.work.wait()
        self.then()


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """dist.reduce_scatter_single(out, x): the sum over ranks of x's rank-th dim-0 block lands in `out`.

    On gloo, an all_to_all of the blocks and a local sum instead: gloo runs reduce_scatter as slowly as an
    all-reduce of the whole tensor (2 CPU ranks, 1 MB: 1.5-2.2 ms against 1.2-1.6 ms for the all-reduce
    and 0.8 ms for this), while all_to_all moves exactly a reduce-scatter's bytes. Other backends (NCCL)
    run their own reduce-scatter."""
    if dist.get_backend(group) != "gloo":
        return dist.reduce_scatter_single(out, x, group=group, async_op=async_op)
    blocks = torch.empty_like(x)  # block r: rank r's contribution to this rank's part
    work = dist.all_to_all_single(blocks, x, group=group, async_op=async_op)

    def add_blocks() -> None:
        torch.sum(blocks.view((dist.get_world_size(group),) + tuple(out.shape)), 0, out=out)

    if not async_op:
        add_blocks()
        return None
    return _Then(work, add_blocks)


def all_gather_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order); the result is laid out `dim`-major."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = _dim_major(x, dim)
    out = x.new_empty((world * x.shape[0],) + x.shape[1:])
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over ranks, each keeping its 1/world slice along `dim`; the result is laid out `dim`-major."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = _dim_major(x, dim)
    out = x.new_empty((x.shape[0] // world,) + x.shape[1:])
    reduce_scatter_single(out, x, group)
    return out.movedim(0, dim)


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return all_gather_dim(x, SEQ_DIM, group)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return reduce_scatter_dim(x, SEQ_DIM, group)


def _split_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=SEQ_DIM)[dist.get_rank(group)].contiguous()  # a contiguous block: no copy


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over `group`, in place when `x` is contiguous (callers pass tensors nothing else reads)."""
    if dist.get_world_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


class _GatherLinear(torch.autograd.Function):
    """F.linear(all_gather_seq(x), weight, bias), saving x's sequence shard rather than the gathered input."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.param = group, bias is not None, weight  # param: the W's target (wgrad.py)
        return F.linear(_all_gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, world = ctx.group, dist.get_world_size(ctx.group)
        # Traced by torch.compile (--torch-compile), the collectives become functional ones that the compiled
        # graph orders itself; dynamo traces no async work objects, so they are issued synchronously there.
        overlap = not torch.compiler.is_compiling()
        shard = x.contiguous()
        gathered = shard.new_empty((world * shard.shape[0],) + shard.shape[1:])
        gather = dist.all_gather_single(gathered, shard, group=group, async_op=overlap)
        grad_input = grad.matmul(weight)  # [s, b, in], contiguous; overlaps the all-gather
        grad_shard = grad_input.new_empty((grad_input.shape[0] // world,) + grad_input.shape[1:])
        if overlap:
            gather.wait()
        scatter = reduce_scatter_single(grad_shard, grad_input, group, async_op=overlap)
        grad2d = grad.reshape(-1, grad.shape[-1])
        # Overlaps the reduce-scatter; or queued for a zero-bubble schedule's W (wgrad.py), which then needs no gather.
        grad_weight = wgrad.weight_grad(ctx.param, grad2d, gathered.view(-1, gathered.shape[-1]))
        grad_bias = grad2d.sum(0) if ctx.has_bias else None
        if overlap:
            scatter.wait()
        return grad_shard, grad_weight, grad_bias, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # In place, no clone: copy_to_tp's output feeds exactly one GEMM (a column-parallel linear's input),
        # so `grad` is that GEMM's fresh input gradient, handed to this node alone (Megatron
        # all-reduces it in place too).
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # In place, no clone: `x` is a fresh partial product (a row-parallel GEMM's or the vocab-parallel
        # embedding's output) that nothing saved for backward - a linear keeps its input, masked_fill its
        # mask. mark_dirty: the output is x itself, modified in place (autograd moves x's history here).
        if not x.is_contiguous():
            return _all_reduce(x, group)  # the collective needs contiguous memory: a copy is reduced
        if torch.compiler.is_compiling():  # traced (--torch-compile), the all-reduce is functional: no alias
            return _all_reduce(x, group).clone()  # a graph output, which inductor writes in place itself
        ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else _GatherFromSeq.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else _ReduceScatterToSeq.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else _ScatterToSeq.apply(x, group)


# ---------------------------------------------------------------- layers


def _mark(p: nn.Parameter, dim: int, group: dist.ProcessGroup, full_size: int) -> nn.Parameter:
    setattr(p, SHARD_ATTR, ShardInfo(dim=dim, rank=dist.get_rank(group), world=dist.get_world_size(group), full_size=full_size))
    return p


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.sequence_parallel = True
    return module


class _TPBase(nn.Module):
    fp8 = None  # native FP8 (tricorn/parallel/fp8.py): its FP8Recipe runs the column/row linears' GEMMs

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.tp = dist.get_world_size(group)

    def _column(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A column-parallel product: under SP all-gather the sequence (saving only the shard), else mark the
        TP fan-out."""
        if self.fp8 is not None:
            sp = self.sequence_parallel and self.tp > 1
            return self.fp8.linear(x if sp else copy_to_tp(x, self.group), weight, bias, self.group if sp else None)
        if self.sequence_parallel and self.tp > 1:
            return _GatherLinear.apply(x, weight, bias, self.group)
        return wgrad.linear(copy_to_tp(x, self.group), weight, bias)


class ColumnParallelLinear(_TPBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group, sequence_parallel: bool):
        super().__init__(group, sequence_parallel)
        if out_features % self.tp:
            raise ValueError(f"output features {out_features} do not divide by TP {self.tp}")
        self.weight = _mark(nn.Parameter(torch.empty(out_features // self.tp, in_features)), 0, group, out_features)
        self.bias = _mark(nn.Parameter(torch.zeros(out_features // self.tp)), 0, group, out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._column(x, self.weight, self.bias)


class RowParallelLinear(_TPBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group, sequence_parallel: bool):
        super().__init__(group, sequence_parallel)
        if in_features % self.tp:
            raise ValueError(f"input features {in_features} do not divide by TP {self.tp}")
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // self.tp)), 1, group, in_features)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = wgrad.linear(x, self.weight) if self.fp8 is None else self.fp8.linear(x, self.weight, None, in_split=True)
        out = reduce_scatter_to_sequence(out, self.group) if self.sequence_parallel else reduce_from_tp(out, self.group)
        # The bias is added once, after the sum, not once per rank.
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(_TPBase):
    """Rows [rank*c, rank*c + real) of the vocabulary, c = ceil(V/tp), zero-padded to V_padded/tp rows."""

    def __init__(
        self, num_embeddings: int, dim: int, scatter_output: bool = False, *, group, sequence_parallel: bool, vocab_size: int
    ):
        super().__init__(group, sequence_parallel)
        self.scatter_output = scatter_output and sequence_parallel
        self.weight = _mark(nn.Parameter(torch.empty(num_embeddings // self.tp, dim)), 0, group, vocab_size)
        self.start, self.real = shard_info(self.weight).real_range()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            out = F.embedding(tokens, self.weight)
            return scatter_to_sequence(out, self.group) if self.scatter_output else out
        local = tokens - self.start
        outside = (local < 0) | (local >= self.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sequence(out, self.group) if self.scatter_output else reduce_from_tp(out, self.group)


class ParallelHead(_TPBase):
    """Output projection producing this rank's slice of the vocabulary logits (never gathered)."""

    def __init__(self, dim: int, num_embeddings: int, tied: bool, *, group, sequence_parallel: bool, vocab_size: int):
        super().__init__(group, sequence_parallel)
        self.weight = None
        if not tied:
            self.weight = _mark(nn.Parameter(torch.empty(num_embeddings // self.tp, dim)), 0, group, vocab_size)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._column(x, self.weight if weight is None else weight)


class SequenceScatter(nn.Module):
    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence(x, self.group)


# ---------------------------------------------------------------- vocab-parallel cross entropy


def _all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """Per-token fp32 loss over logits split by vocabulary: the slices' log-sum-exps and target logits are
    combined with three all-reduces of [b, s] fp32 tensors; the logits are never gathered."""
    if dist.get_world_size(group) == 1:
        return masked_cross_entropy(logits, labels, vocab_size)
    start, real = ShardInfo(0, dist.get_rank(group), dist.get_world_size(group), vocab_size).real_range()
    return cross_entropy(
        logits,
        labels,
        start,
        real,
        reduce_max=functools.partial(_all_reduce_max, group=group),
        reduce_sum=functools.partial(_all_reduce, group=group),
    )


# ---------------------------------------------------------------- the default RNG stream


def seed_default_stream(seed: int, pp_rank: int) -> None:
    """Megatron's per-stage offset for the default stream. Dropout draws its masks from its own generators
    (tricorn/model/dropout.py), so no TP-rank stream is needed; this stream serves any other randomness."""
    torch.manual_seed(seed + 100 * pp_rank)


# ---------------------------------------------------------------- the spec


def tensor_parallel_spec(cfg: Config, tp_group: dist.ProcessGroup) -> LayerSpec:
    """The layer spec that makes the decoder tensor (and sequence) parallel over `tp_group`."""
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    sp = cfg.parallel.sequence_parallel and tp_size > 1
    vocab = cfg.model.vocab_size
    common = dict(group=tp_group, sequence_parallel=sp)

    def norm(dim: int, kind: str, eps: float) -> nn.Module:
        module = make_norm(dim, kind, eps, wgrad.defer)
        return mark_sequence_parallel(module) if sp else module

    def head_norm(dim: int, kind: str, eps: float) -> nn.Module:
        # --qk-layernorm: replicated, but each TP rank normalises only its own heads (SP or not): a partial
        # gradient per rank, summed over TP like the SP norms' (Megatron's finalize_model_grads does the same).
        module = make_norm(dim, kind, eps, wgrad.defer)
        return mark_sequence_parallel(module) if tp_size > 1 else module

    return LayerSpec(
        column_linear=functools.partial(ColumnParallelLinear, **common),
        row_linear=functools.partial(RowParallelLinear, **common),
        embedding=functools.partial(VocabParallelEmbedding, **common, vocab_size=vocab),
        sequence_scatter=(lambda: SequenceScatter(tp_group)) if sp else nn.Identity,
        output_head=functools.partial(ParallelHead, **common, vocab_size=vocab),
        cross_entropy=lambda logits, labels, v: vocab_parallel_cross_entropy(logits, labels, v, tp_group),
        norm=norm,
        head_norm=head_norm,
        # The norms' and the routed experts' weight gradients: to a zero-bubble W while one is open (wgrad.py).
        weight_grad=wgrad.defer,
        sequence_shards=tp_size if sp else 1,
        # Dropout masks are drawn by global sample, head and position (model/dropout.py), so every TP
        # rank drops exactly what one process would: it only needs to know where its slice sits.
        dropout_seed=cfg.training.seed,
        tp_rank=tp_rank,
        sequence_shard_rank=tp_rank if sp else 0,
        # MoE routers (model/moe.py) see a sequence shard under SP: their copy counts sum over TP (no gradient).
        sequence_sum=(lambda t: _all_reduce(t.clone(), tp_group)) if sp else None,
    )


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelHead",
    "HeadLinear",
    "tensor_parallel_spec",
    "vocab_parallel_cross_entropy",
]
