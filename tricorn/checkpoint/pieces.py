"""The pieces of the global tensors a rank owns, as DCP tensors that read and write its live state in place.

A rank owns, per parameter, the element range [start, stop) of p.view(-1) of its TP-local parameter that its
optimizer shard covers (tricorn.parallel.shard_state.ParamShard: all of it without the distributed optimizer,
1/(DP x CP) of each bucket with it, whatever the ZeRO stage). A contiguous range of a row-major [rows, cols]
tensor is at most three rectangles - the rest of a first row, whole rows, the start of a last row - and each
rectangle, moved by the TP rank's offset along the split dimension and clipped to the real rows (vocabulary
padding is never saved), is a chunk of the global tensor. ``owned_tensor`` wraps those chunks, as views of the
flat owned state (parameter values, master, moments), in a ShardedTensor whose metadata lists only this rank's
chunks: DCP merges every rank's chunks into the checkpoint's metadata on save, and on load reads whatever
saved chunks overlap the requested ones, so any layout loads any other (TP, PP, VPP, DP, CP, ZeRO stage).

A mixture of experts' stacked weight [E/EP, rows, cols] (the rank's experts of E, model/moe.py) is saved as
one 2-D tensor per expert under the expert's global name (``expert_name``: ...experts.<e>.w1): ``owned_parts``
cuts the owned range at expert boundaries, and each part is pieces of its expert's matrix (under expert tensor
parallelism TP-sliced like a dense weight) - so a checkpoint does not depend on the expert-parallel split or ETP, and an expert loads on whichever rank holds it.

Nothing is gathered and nothing is copied: a save writes from, and a load reads into, the optimizer's own
flat buffers. No collectives here (DCP's plan gathers are the only ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardingSpec

from tricorn.model.init import ShardInfo, expert_matrix_shape, expert_name, expert_tp_info, global_shape, is_expert, shard_info


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of the owned flat range, which form the rectangle `sizes` at `offsets` globally."""

    lo: int
    hi: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _rectangles(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(flat start, local offsets, sizes) of the rectangles covering [start, stop) of a row-major tensor."""
    if len(shape) == 1:
        return [(start, (start,), (stop - start,))] if stop > start else []
    if len(shape) != 2:
        raise ValueError(f"checkpoint pieces support 1-D and 2-D parameters, not shape {shape}")
    cols = shape[1]
    out = []
    pos = start
    while pos < stop:
        row, col = divmod(pos, cols)
        if col or stop - pos < cols:  # a partial row
            end = min(stop, (row + 1) * cols)
            out.append((pos, (row, col), (1, end - pos)))
        else:  # whole rows
            end = pos + (stop - pos) // cols * cols
            out.append((pos, (row, 0), ((end - pos) // cols, cols)))
        pos = end
    return out


@dataclass(frozen=True)
class OwnedPart:
    """Elements [lo, hi) of the owned flat range that hold (part of) the global tensor `name` of `shape`;
    the pieces' lo/hi count from `lo`."""

    name: str
    lo: int
    hi: int
    shape: tuple[int, ...]
    pieces: list[Piece]


def owned_parts(name: str, p: torch.Tensor, start: int, stop: int) -> list[OwnedPart]:
    """The global tensors elements [start, stop) of p.view(-1) belong to: `name` itself, or for MoE experts one
    tensor per expert (module docstring); parts without real elements are left out."""
    if not is_expert(p):
        pieces = owned_pieces(p, start, stop)
        return [OwnedPart(name, 0, stop - start, global_shape(p), pieces)] if pieces else []
    shape, first, tp, full = tuple(p.shape[1:]), shard_info(p).real_range()[0], expert_tp_info(p), expert_matrix_shape(p)
    size = math.prod(shape)
    parts = []
    for j in range(start // size, -(-stop // size)):
        lo, hi = max(start, j * size), min(stop, (j + 1) * size)
        if hi <= lo:
            continue
        pieces = _pieces(shape, tp, lo - j * size, hi - j * size)  # TP-sliced like a dense weight (expert TP)
        parts.append(OwnedPart(expert_name(name, first + j), lo - start, hi - start, full, pieces))
    return parts


def owned_pieces(p: torch.Tensor, start: int, stop: int) -> list[Piece]:
    """The global rectangles of elements [start, stop) of p.view(-1), real rows only (module docstring)."""
    return _pieces(tuple(p.shape), shard_info(p), start, stop)


def _pieces(shape: tuple[int, ...], info: Optional[ShardInfo], start: int, stop: int) -> list[Piece]:
    pieces = []
    for first, offsets, sizes in _rectangles(shape, start, stop):
        offsets, sizes = list(offsets), list(sizes)
        if info is not None:
            shift, real = info.real_range()
            end = min(offsets[info.dim] + sizes[info.dim], real)  # clip the padding rows
            if end <= offsets[info.dim]:
                continue
            sizes[info.dim] = end - offsets[info.dim]
            offsets[info.dim] += shift
        lo = first - start
        n = sizes[0] * (sizes[1] if len(sizes) == 2 else 1)
        pieces.append(Piece(lo, lo + n, tuple(offsets), tuple(sizes)))
    return pieces


class _OwnPieces(ShardingSpec):
    """The layout of one rank's pieces only. torch's specs check that the shards cover the whole tensor, which
    holds for no single rank here; DCP needs no more than each rank's own chunks (it merges them)."""

    def __init__(self, metadata: ShardedTensorMetadata):
        self.metadata = metadata

    def build_metadata(self, tensor_sizes: torch.Size, tensor_properties: TensorProperties) -> ShardedTensorMetadata:
        return self.metadata

    def shard(self, tensor: torch.Tensor, src_rank: int = 0, process_group=None):
        raise NotImplementedError("checkpoint pieces are built from local shards only")


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """`view` (contiguous) as a tensor whose storage is exactly its bytes, still aliasing the same memory.

    DCP's writer clones any tensor whose storage is larger than the tensor and keeps every clone of a file
    until the file is written - a whole copy of the rank's state. A sliced storage is a non-owning alias,
    valid while `view`'s buffer lives (the save's duration). CPU only: DCP copies device tensors to the host
    one item at a time anyway."""
    if view.device.type != "cpu" or view.untyped_storage().nbytes() == view.nbytes:
        return view
    start = view.storage_offset() * view.element_size()
    storage = view.untyped_storage()[start : start + view.nbytes]
    return torch.empty(0, dtype=view.dtype).set_(storage, 0, view.shape)


def owned_tensor(flat: torch.Tensor, shape: tuple[int, ...], pieces: list[Piece]) -> ShardedTensor:
    """A ShardedTensor of global `shape` whose local shards are views of `flat` (the owned range)."""

    placement = f"rank:{dist.get_rank()}/{flat.device}"
    shards, metas = [], []
    for piece in pieces:
        meta = ShardMetadata(list(piece.offsets), list(piece.sizes), placement)
        shards.append(Shard(_own_storage(flat[piece.lo : piece.hi].view(piece.sizes)), meta))
        metas.append(meta)
    props = TensorProperties(
        dtype=flat.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=flat.is_pinned(),
    )
    metadata = ShardedTensorMetadata(metas, torch.Size(shape), props)
    # Built as torch's _init_from_local_shards_and_global_metadata does, minus its whole-tensor coverage check.
    tensor = ShardedTensor.__new__(
        ShardedTensor,
        _OwnPieces(metadata),
        *metadata.size,
        dtype=flat.dtype,
        layout=torch.strided,
        pin_memory=props.pin_memory,
        requires_grad=False,
    )
    tensor._local_shards = shards
    tensor._prepare_init(process_group=None, init_rrefs=False)
    tensor._post_init()
    return tensor
