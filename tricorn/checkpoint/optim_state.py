"""Optimizer state in each state's own dtype (--use-precision-aware-optimizer), and a switch of dtype on load.

Keys, beside checkpointer.py's:
    optim.<name>.exp_avg/.exp_avg_sq          in the dtype the optimizer stores them in: fp32, bf16, or fp16 as
                                              stored (times the parameter's power-of-two scale)
    optim.<name>.exp_avg_bound/_sq_bound      fp16 moments only: the per-parameter bound their scale comes from
                                              (one fp32 for the whole parameter tensor, parallel/precision.py)
    optim.<name>.master                       only where the master is a copy in a dtype other than the
                                              parameter's (fp32 beside 16-bit parameters); a 16-bit master is the
                                              parameter itself, saved as model.<name>
and meta.json's ``optimizer_dtypes`` (master, exp_avg, exp_avg_sq). Every state is elementwise in global
coordinates (the fp16 scale is global per parameter), so any layout loads any other.

A load into other dtypes than the saved ones prints one line naming each switch. bf16 <-> fp32 converts as DCP
reads (to nearest); a switch from or to fp16 reads the saved values into fp32 buffers of the owned range
(transient: 4 bytes per owned element per switched moment), unscales fp16 by its saved bound, and stores them
again (into fp16 with a bound equal to the loaded values' largest magnitude, one MAX all-reduce over the stage).
No collectives besides that one; memory: as said.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from tricorn.checkpoint.io import CheckpointError
from tricorn.checkpoint.pieces import Piece, owned_parts, owned_tensor
from tricorn.parallel.precision import MOMENTS, NAMES, from_storage, moment_scale

SCALAR = ((1,), [Piece(0, 1, (0,), (1,))])  # a one-element global tensor, written whole by one rank


def bound_key(name: str, moment: str) -> str:
    return f"optim.{name}.{moment}_bound"


def saved_fields(ps) -> tuple[str, ...]:
    """The optimizer fields a checkpoint keeps for a parameter: the moments, and the master where it is a copy
    in another dtype (an fp32 master of 16-bit parameters). An FP8 primary weight's `value` is its fp32 master
    (the FP8 bytes are a cast of it), so that master is saved as the model tensor, in fp32, not as a field."""
    return MOMENTS + (("master",) if ps.master.dtype != ps.value.dtype else ())


def state_dtypes(opt) -> dict[str, str]:
    """meta.json's optimizer_dtypes: each state's stored dtype (fp32 for an optimizer without the choice)."""
    dtypes = getattr(opt, "dtypes", None)
    if dtypes is None:
        return {"master": "fp32", "exp_avg": "fp32", "exp_avg_sq": "fp32"}
    return {k: NAMES[getattr(dtypes, k)] for k in ("master", "exp_avg", "exp_avg_sq")}


def bound_tensors(opt, name_of: dict[int, str], writes: Callable[[torch.nn.Parameter], bool]) -> dict[str, tuple]:
    """fp16 moments' bounds, one per parameter tensor, each written by the one rank ``writes`` names."""
    out: dict[str, tuple] = {}
    for moment, bounds in getattr(opt, "moment_bounds", {}).items():
        for k, p in enumerate(opt.params):
            if writes(p):
                out[bound_key(name_of[id(p)], moment)] = (bounds[k : k + 1], SCALAR)
    return out


def switch_line(saved: Optional[dict], current: dict[str, str]) -> Optional[str]:
    """One line naming each state whose dtype changes on this load (None when none does)."""
    saved = saved or {"master": "fp32", "exp_avg": "fp32", "exp_avg_sq": "fp32"}
    changes = [f"{k} {saved.get(k, 'fp32')} -> {v}" for k, v in current.items() if saved.get(k, "fp32") != v]
    if not changes:
        return None
    return (
        "checkpoint: optimizer state saved in other dtypes, converted on load: "
        + ", ".join(changes)
        + " (to nearest; fp16 moments rescaled)"
    )


def _saved_dtype(md, key: str) -> torch.dtype:
    return md.state_dict_metadata[key].properties.dtype


class MomentLoad:
    """Targets for the Adam moments of a load, and what to do after DCP has read them (module docstring)."""

    def __init__(self, opt, md):
        self.opt, self.md = opt, md
        self.bounds = getattr(opt, "moment_bounds", {})
        self.index = {id(p): k for k, p in enumerate(opt.params)}
        self.staged: dict[str, dict[int, tuple[Any, torch.Tensor]]] = {m: {} for m in MOMENTS}  # id(p) -> (ps, fp32)
        self.saved_bounds: dict[str, torch.Tensor] = {}  # moment -> per-parameter bound read from the checkpoint

    def _via_fp32(self, moment: str, saved: torch.dtype) -> bool:
        current = getattr(self.opt.dtypes, moment) if hasattr(self.opt, "dtypes") else torch.float32
        return saved != current and torch.float16 in (saved, current)

    def targets(self, name: str, ps, check: Callable[[str, tuple], None]) -> dict[str, Any]:
        """DCP targets for parameter `name`'s moments on this rank (and the bounds its fp16 moments need)."""
        out: dict[str, Any] = {}
        for moment in MOMENTS:
            parts = owned_parts(name, ps.param, ps.start, ps.stop)
            for part in parts:
                check(f"optim.{part.name}.{moment}", part.shape)
            key = f"optim.{parts[0].name}.{moment}" if parts else None
            saved = _saved_dtype(self.md, key) if key else None
            via = saved is not None and self._via_fp32(moment, saved)
            if via:
                buffer = torch.zeros(ps.stop - ps.start, dtype=torch.float32, device=getattr(ps, moment).device)
                self.staged[moment][id(ps.param)] = (ps, buffer)
            else:
                buffer = getattr(ps, moment)
            for part in parts:
                out[f"optim.{part.name}.{moment}"] = owned_tensor(buffer[part.lo : part.hi], part.shape, part.pieces)
            if saved == torch.float16:
                out.update(self._bound_target(name, moment, ps.param, via))
        return out

    def _bound_target(self, name: str, moment: str, param, via_fp32: bool) -> dict[str, Any]:
        """The saved bound of an fp16 moment: into the optimizer's own bound (fp16 -> fp16), else into a buffer
        that unscales the values read (fp16 -> another dtype)."""
        key = bound_key(name, moment)
        if key not in self.md.state_dict_metadata:
            raise CheckpointError(f"checkpoint lacks {key!r}, the scale of its fp16 {moment}; it is damaged")
        k = self.index[id(param)]
        if not via_fp32:
            return {key: owned_tensor(self.bounds[moment][k : k + 1], *SCALAR)}
        saved = self.saved_bounds.setdefault(moment, torch.zeros(len(self.opt.params), device=self.opt.state.device))
        return {key: owned_tensor(saved[k : k + 1], *SCALAR)}

    def finish(self) -> None:
        """After DCP's read: unscale what was saved in fp16, and store every staged moment in its current dtype."""
        for moment, staged in self.staged.items():
            if moment in self.saved_bounds:
                scales = moment_scale(self.saved_bounds[moment])
                for pid, (_ps, values) in staged.items():
                    from_storage(values, values, scales[self.index[pid]].to(values.device))
            if staged or self._switches(moment):
                self.opt.store_moments(moment, {pid: values for pid, (_ps, values) in staged.items()})

    def _switches(self, moment: str) -> bool:
        """Whether this moment switches dtype through fp32 on some rank: a rank owning nothing still joins the
        fp16 bound's all-reduce (the saved dtype is the same in every rank's view of the checkpoint)."""
        keys = [k for k in self.md.state_dict_metadata if k.startswith("optim.") and k.endswith("." + moment)]
        return bool(keys) and self._via_fp32(moment, _saved_dtype(self.md, keys[0]))
