"""Megatron's distributed-optimizer state -> per-parameter tensors: torch_dist `dp_reshardable` and legacy `distrib_optim.pt`.

Megatron's distributed optimizer keeps the fp32 master weights and the Adam moments in flat buffers that shadow
DDP's gradient buffers, and saves them as such. The layout, as megatron-core 0.19's
DistributedOptimizer._compute_per_buffer_param_layout and training.get_model build it, for each model chunk
(one per pipeline stage; no virtual stages here) and TP rank:
  - one buffer per (param dtype, grad dtype, expert or not): a dense model has one;
  - the chunk's trainable parameters in reverse registration order (the order GPTModel's modules create them,
    `stage_params`), each starting on a 64-element boundary;
  - a bucket closes once it holds at least the bucket size: `--ddp-bucket-size`, else num_params //
    `--ddp-num-buckets`, else max(40M, 1M x DP x CP); no limit (one bucket) without `--overlap-grad-reduce`, on
    pipeline stages after the first, or with `--overlap-param-gather-with-optimizer-step`. A shared embedding
    (tied weights at PP > 1) gets a bucket of its own;
  - positions count from the bucket's start (a bucket starts on a multiple of 128); the padding after a bucket's
    last parameter (to a multiple of DP, for the reduce-scatter) is not saved, so the saved layout does not
    depend on DP.
torch_dist `dp_reshardable` stores bucket b of buffer g as 1-D tensors
`optimizer.distributed.dp_group_idx_{m}.gbuf_idx_{g}.dtype_({param}, {grad}).bucket_idx_{b}.{param,exp_avg,exp_avg_sq}`
(m: the model-parallel rank, tp + TP x pp), beside `...dp_group_idx_{m}.per_bucket_numel_unpadded`. The legacy
format's `mp_rank_XX[_YYY]/distrib_optim.pt` holds per buffer the buckets' saved contents one after another
(`buckets_coalesced`; the pre-2024 format is refused).

Nothing is guessed: the layout derived from the args must give the bucket sizes the checkpoint saved (else one
line names the bucket), and every parameter's fp32 master must equal the checkpoint's weight (`check_masters`).
Reads one parameter's slice at a time (torch_dist) or one rank's file (legacy). No collectives.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tricorn.checkpoint.interop.hf_mapping import ConvertError
from tricorn.checkpoint.interop.megatron_mapping import Entry, merge_tp, tricorn_shape
from tricorn.config import ModelConfig

FIELDS = ("param", "exp_avg", "exp_avg_sq")
PARAM_ALIGN = 64  # a parameter starts on a multiple of this (param_layout.pad_param_start)
# A transformer layer's parameters in registration order, by their name after `decoder.layers.<i>.`. TransformerLayer
# builds the input norm, the attention (Attention builds linear_proj before SelfAttention adds linear_qkv), the
# pre-MLP norm, the MLP; Transformer Engine's LayerNormLinear registers its fused norm before its weight and bias.
LAYER_ORDER = {
    "local": (
        "input_layernorm.weight",
        "input_layernorm.bias",
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "pre_mlp_layernorm.weight",
        "pre_mlp_layernorm.bias",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2.bias",
    ),
    "transformer_engine": (
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_bias",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2.bias",
    ),
}
_BUCKET_KEY = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$")


@dataclass(frozen=True)
class Param:
    """One trainable parameter of a Megatron model chunk, on one TP rank."""

    name: str  # Megatron's name on its stage (layers numbered locally)
    entry: Optional[Entry]  # the tricorn tensor it is (a TP piece of); None: the last stage's copy of tied embeddings
    shape: tuple[int, ...]  # on this TP rank
    shared_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Slot:
    """Where a Param's state lies: elements [start, end) of bucket `bucket` (legacy: of the buffer) of rank (tp, pp)."""

    tp: int
    pp: int
    bucket: int
    start: int
    end: int
    shape: tuple[int, ...]


def stage_layer_counts(args: dict, where: str) -> list[int]:
    """Layers per pipeline stage: even, or with --decoder-first/last-pipeline-num-layers as Megatron splits them."""
    pp, layers = int(args.get("pipeline_model_parallel_size") or 1), int(args["num_layers"])
    for name in (
        "pipeline_model_parallel_layout",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
    ):
        if args.get(name):
            raise ConvertError(
                f"{where}: --{name.replace('_', '-')} places the layers in a way tricorn's optimizer import does not map"
            )
    if pp == 1:
        return [layers]
    given = [args.get("decoder_first_pipeline_num_layers"), *[None] * (pp - 2), args.get("decoder_last_pipeline_num_layers")]
    rest = layers - sum(g for g in given if g)
    free = sum(1 for g in given if not g)
    if free and rest % free:
        raise ConvertError(f"{where}: {layers} layers do not split over {pp} pipeline stages as the args say")
    return [int(g) if g else rest // max(free, 1) for g in given]


def stage_params(args: dict, m: ModelConfig, entries: list[Entry], pp: int, where: str) -> list[Param]:
    """Megatron's trainable parameters of pipeline stage pp on each TP rank, in registration order (GPTModel: the
    embeddings, the stage's layers, the final norm, the output layer)."""
    impl = args.get("transformer_impl") or "transformer_engine"
    if impl not in LAYER_ORDER:
        raise ConvertError(
            f"{where}: --transformer-impl {impl}: tricorn maps the distributed optimizer's buffers of local and transformer_engine layers"
        )
    tp_size, pp_size = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    counts = stage_layer_counts(args, where)
    first_layer = sum(counts[:pp])
    by_name: dict[str, Entry] = {}
    for e in entries:
        if e.layer is None:
            by_name[e.dist] = e
        elif impl == "local":
            by_name[e.legacy] = e
        else:
            by_name[f"decoder.layers.{e.layer}.{e.dist.removeprefix('decoder.layers.')}"] = e

    def local(e: Entry) -> tuple[int, ...]:
        shape = list(tricorn_shape(e, m))
        if e.tp_dim is not None:
            shape[e.tp_dim] //= tp_size
        return tuple(shape)

    out: list[Param] = []
    tied_stages = not m.untie_embeddings_and_output_weights and pp_size > 1
    if pp == 0:
        for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
            if name in by_name:
                out.append(Param(name, by_name[name], local(by_name[name]), tied_stages and "word" in name))
    for j in range(counts[pp]):
        for suffix in LAYER_ORDER[impl]:
            e = by_name.get(f"decoder.layers.{first_layer + j}.{suffix}")
            if e is not None:
                out.append(Param(f"decoder.layers.{j}.{suffix}", e, local(e)))
    if pp == pp_size - 1:
        for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"):
            if name in by_name:
                out.append(Param(name, by_name[name], local(by_name[name])))
        if tied_stages:  # the last stage's copy of the word embeddings, kept equal by an all-reduce
            emb = by_name["embedding.word_embeddings.weight"]
            out.append(Param("output_layer.weight", None, local(emb), True))
    return out


def bucket_size(args: dict, pp: int, num_params: int) -> Optional[int]:
    """The bucket size DDP gets (training.resolve_ddp_bucket_size and get_model); None: one bucket."""
    if not args.get("overlap_grad_reduce") or pp > 0 or args.get("overlap_param_gather_with_optimizer_step"):
        return None
    if args.get("ddp_num_buckets"):
        return num_params // int(args["ddp_num_buckets"])
    if args.get("ddp_bucket_size"):
        return int(args["ddp_bucket_size"])
    dp_cp = int(args.get("data_parallel_size") or 1) * int(args.get("context_parallel_size") or 1)
    return max(40_000_000, 1_000_000 * dp_cp)


def bucket_layout(params: list[Param], size: Optional[int]) -> tuple[dict[str, tuple[int, int, int]], list[int]]:
    """name -> (start, end, bucket) counted from the bucket's start, and each bucket's saved (unpadded) length."""
    index: dict[str, tuple[int, int, int]] = {}
    lengths: list[int] = []
    start = end = members = 0
    for p in reversed(params):
        start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        if p.shared_embedding and members:  # Megatron closes the bucket at the padded start
            lengths.append(start)
            start = members = 0
        end = start + p.numel
        index[p.name] = (start, end, len(lengths))
        members += 1
        if (size is not None and end >= size) or p.shared_embedding:
            lengths.append(end)
            start = members = 0
        else:
            start = end
    if members:
        lengths.append(end)
    return index, lengths


def _bucket_args(args: dict) -> str:
    flags = [f"--{k.replace('_', '-')} {args[k]}" for k in ("ddp_bucket_size", "ddp_num_buckets") if args.get(k)]
    overlap = "--overlap-grad-reduce" if args.get("overlap_grad_reduce") else "no --overlap-grad-reduce"
    return " ".join([overlap, *flags, f"DP {args.get('data_parallel_size', 1)}"])


class DistOptState:
    """The per-parameter state of a Megatron distributed optimizer, read from its flat buffers.

    read(tp, pp, field, bucket, start, end) returns elements [start, end) of the saved bucket (dp_reshardable) or
    buffer (legacy: `bucket` is then ignored and offsets count from the buffer's start)."""

    def __init__(
        self,
        args: dict,
        m: ModelConfig,
        entries: list[Entry],
        saved_lengths: Callable[[int, int], list[int]],
        read: Callable[[int, int, str, int, int, int], torch.Tensor],
        coalesced: bool,
        where: str,
    ):
        if args.get("num_layers_per_virtual_pipeline_stage") or args.get("virtual_pipeline_model_parallel_size"):
            raise ConvertError(f"{where}: virtual pipeline stages: tricorn does not map their distributed-optimizer buffers")
        if int(args.get("num_distributed_optimizer_instances") or 1) != 1:
            raise ConvertError(f"{where}: --num-distributed-optimizer-instances > 1: tricorn does not map its buffers")
        if args.get("use_precision_aware_optimizer"):
            raise ConvertError(f"{where}: --use-precision-aware-optimizer stores its state in a form tricorn does not map")
        self.read = read
        self.slots: dict[str, list[Slot]] = {}  # tricorn name -> one slot per TP rank, in TP order
        tp_size, pp_size = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
        for pp in range(pp_size):
            for tp in range(tp_size):
                params = stage_params(args, m, entries, pp, where)
                index, ours = bucket_layout(params, bucket_size(args, pp, sum(p.numel for p in params)))
                saved = saved_lengths(tp, pp)
                rank = f"TP rank {tp}, PP rank {pp}"
                if coalesced:  # legacy: only the buffer's total is saved
                    if sum(saved) != sum(ours):
                        raise ConvertError(
                            f"{where}: the distributed optimizer's buffer of {rank} holds {sum(saved)} elements, the args "
                            f"({_bucket_args(args)}) imply {sum(ours)}; tricorn does not guess Megatron's buffer layout"
                        )
                elif saved != ours:
                    b = next((i for i, (a, o) in enumerate(zip(saved, ours)) if a != o), min(len(saved), len(ours)))
                    have = saved[b] if b < len(saved) else "no"
                    want = ours[b] if b < len(ours) else "no"
                    raise ConvertError(
                        f"{where}: bucket {b} of the distributed optimizer's buffer of {rank} holds {have} elements, the "
                        f"args ({_bucket_args(args)}) imply {want} ({len(saved)} buckets saved, {len(ours)} implied); "
                        "tricorn does not guess Megatron's bucket layout"
                    )
                offsets = [sum(ours[:b]) for b in range(len(ours))] if coalesced else [0] * len(ours)
                for p in params:
                    if p.entry is None:
                        continue
                    start, end, b = index[p.name]
                    self.slots.setdefault(p.entry.name, []).append(Slot(tp, pp, b, offsets[b] + start, offsets[b] + end, p.shape))

    def tensor(self, e: Entry, field: str) -> torch.Tensor:
        """Megatron's global `field` (param, exp_avg, exp_avg_sq) of tricorn tensor `e`, TP pieces merged, fp32."""
        pieces = [self.read(s.tp, s.pp, field, s.bucket, s.start, s.end).float().view(s.shape) for s in self.slots[e.name]]
        return merge_tp(e, pieces)

    def check_masters(self, entries: list[Entry], weight: Callable[[Entry], torch.Tensor], where: str) -> None:
        """Every fp32 master must be its weight (exactly, or rounded to the weights' bf16/fp16): the derived layout
        puts each parameter where Megatron did."""
        for e in entries:
            w = weight(e)
            master = self.tensor(e, "param")
            if not torch.equal(master.to(w.dtype), w):
                raise ConvertError(
                    f"{where}: the distributed optimizer's master weights of {e.dist} are not its weights where the "
                    "args place them in Megatron's buffers; tricorn does not guess the layout (import with --no-load-optim)"
                )


def bucket_lengths(per_bucket: Any, where: str) -> list[int]:
    """The bucket sizes of a dp_reshardable `per_bucket_numel_unpadded` object: one buffer, one dtype pair."""
    if not isinstance(per_bucket, list) or len(per_bucket) != 1 or not isinstance(per_bucket[0], dict) or len(per_bucket[0]) != 1:
        raise ConvertError(
            f"{where}: the distributed optimizer keeps {len(per_bucket) if isinstance(per_bucket, list) else '?'} gradient "
            "buffers (several param/grad dtypes or expert parameters); tricorn maps a dense model's one buffer"
        )
    return [int(n) for n in next(iter(per_bucket[0].values()))]


def bucket_key(keys: Any, m: int, bucket: int, field: str) -> Optional[str]:
    """The dp_reshardable tensor key of bucket `bucket`'s `field` on model-parallel rank m, from the metadata's keys."""
    for key in keys:
        found = _BUCKET_KEY.match(key)
        if found and (int(found[1]), int(found[2]), int(found[4]), found[5]) == (m, 0, bucket, field):
            return key
    return None


def legacy_buffer(state: Any, where: str) -> dict[str, torch.Tensor]:
    """The one buffer's world tensors of a legacy `distrib_optim.pt` (buckets coalesced, as megatron-core >= 0.6 saves)."""
    if not isinstance(state, dict) or not state.get("buckets_coalesced"):
        raise ConvertError(
            f"{where}: a distrib_optim.pt in the pre-2024 layout; convert it in Megatron with "
            "--ckpt-convert-update-legacy-dist-opt-format, or import with --no-load-optim"
        )
    buffers = [v for k, v in state.items() if isinstance(k, int)]
    if len(buffers) != 1 or not isinstance(buffers[0], dict) or len(buffers[0]) != 1:
        raise ConvertError(
            f"{where}: the distributed optimizer keeps {len(buffers)} gradient buffers; tricorn maps a dense model's one buffer"
        )
    world = next(iter(buffers[0].values()))
    missing = [f for f in FIELDS if not isinstance(world.get(f), torch.Tensor)]
    if missing:
        raise ConvertError(f"{where}: distrib_optim.pt has no {missing[0]} (an optimizer other than Adam)")
    return world
