"""The precision-aware optimizer (--use-precision-aware-optimizer): which dtype each AdamW state is stored in, and
how a value is rounded into it.

Megatron's flags, with Megatron's meaning: --main-grads-dtype (the gradient buffers), --main-params-dtype (the
master weights), --exp-avg-dtype and --exp-avg-sq-dtype (AdamW's moments). The update is always computed in
fp32: shard_state.py widens a bucket's stored states into fp32 work buffers, runs torch's AdamW on them, and
rounds the results back into storage. Where a value is rounded, and how:

    exp_avg, exp_avg_sq  bf16: to nearest (as Transformer Engine's FusedAdam and torchtitan do).
                         fp16: to nearest after multiplying by a per-parameter power of two, so that the
                         moment's range (exp_avg_sq spans the squares of the gradients) sits inside fp16's.
                         The scale comes from an upper bound of the parameter's largest moment, which AdamW's
                         recurrences give before the step: |m_t| <= b1 B_{t-1} + (1 - b1) G_t and
                         |v_t| <= b2 B_{t-1} + (1 - b2) G_t^2, with G_t the largest |gradient| of the whole
                         parameter (one MAX all-reduce over the stage's TP x DP x CP ranks of one fp32 per
                         parameter tensor). The bound is state (checkpointed per parameter); a power of two makes
                         scaling and unscaling exact, and the bound being global makes the stored values the
                         same at every layout.
    master weights       fp32: a copy, as before. bf16 with --bf16, fp16 with --fp16: the 16-bit parameters
                         ARE the master (no copy), and each update is written with stochastic rounding (round
                         up with probability equal to the distance from the lower neighbour over the spacing):
                         nearest rounding would drop every update below half a unit in the last place, which
                         at bf16's 8 bits is most of them late in training; stochastic rounding is unbiased.
                         Its random numbers are keyed, like dropout's (model/dropout.py): a hash of (seed,
                         optimizer step, the parameter's global name, the element's index in the global
                         tensor), so every layout rounds every element alike, a resume continues the same
                         sequence, and TP replicas and tied copies stay identical.
    main grads           fp32, or bf16 (--bf16 only): the gradient buffers' dtype, as --grad-reduce-in-bf16.

A 16-bit master needs the parameters in that dtype (an fp16 master beside bf16 parameters could not hold what
bf16 holds: the "fp16 main params without loss scaling" of the issue), and FP8 primary weights
(--fp8-param-gather) need the fp32 master as their source of truth: validate_precision refuses the rest, one
line each. No collectives here (the bound's all-reduce is issued by optimizer.py); memory: see shard_state.py.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from tricorn.checkpoint.pieces import owned_parts
from tricorn.config import Config
from tricorn.model.dropout import mix_seed
from tricorn.parallel.fp8 import scale_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}
MOMENTS = ("exp_avg", "exp_avg_sq")
_M32 = 0xFFFFFFFF
_MUL = 0x5BD1E995  # an odd multiplier below 2^31 (MurmurHash2's): products of 32-bit values stay inside int64


@dataclass(frozen=True)
class StateDtypes:
    """The stored dtype of each optimizer state (all fp32 without --use-precision-aware-optimizer)."""

    master: torch.dtype = torch.float32
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, cfg: Config) -> StateDtypes:
        t = cfg.training
        if not t.use_precision_aware_optimizer:
            return cls()
        return cls(DTYPES[t.main_params_dtype], DTYPES[t.exp_avg_dtype], DTYPES[t.exp_avg_sq_dtype])

    def moment(self, name: str) -> torch.dtype:
        return getattr(self, name)

    @property
    def all_fp32(self) -> bool:
        return self.master == self.exp_avg == self.exp_avg_sq == torch.float32

    @property
    def scaled(self) -> tuple[str, ...]:
        """The moments stored in fp16, which carry a per-parameter scale."""
        return tuple(m for m in MOMENTS if self.moment(m) == torch.float16)


def validate_precision(cfg: Config) -> list[str]:
    """The precision-aware optimizer's dtype combinations it cannot honour, one sentence each (before launch)."""
    t = cfg.training
    chosen = {
        "--main-grads-dtype": t.main_grads_dtype,
        "--main-params-dtype": t.main_params_dtype,
        "--exp-avg-dtype": t.exp_avg_dtype,
        "--exp-avg-sq-dtype": t.exp_avg_sq_dtype,
    }
    if not t.use_precision_aware_optimizer:
        low = [f"{flag} {value}" for flag, value in chosen.items() if value != "fp32"]
        if low:
            return [f"{', '.join(low)} needs --use-precision-aware-optimizer (without it every optimizer state is fp32)"]
        return []
    errs = []
    params = cfg.param_dtype_name
    if t.main_grads_dtype == "bf16" and params != "bf16":
        errs.append(
            f"--main-grads-dtype bf16 needs --bf16: gradients accumulate in the parameters' 16-bit dtype, and these are {params}; "
            "use --main-grads-dtype fp32"
        )
    if t.main_params_dtype != "fp32" and t.main_params_dtype != params:
        want = {"bf16": "--bf16", "fp16": "--fp16 (and its loss scaling)"}[t.main_params_dtype]
        errs.append(
            f"--main-params-dtype {t.main_params_dtype} needs {want}: a 16-bit master is the parameters themselves, "
            f"and {params} parameters hold what a {t.main_params_dtype} master could not; use --main-params-dtype fp32"
        )
    fp16 = [f for f in ("--exp-avg-dtype", "--exp-avg-sq-dtype") if chosen[f] == "fp16"]
    if fp16 and cfg.parallel.expert_model_parallel_size > 1:
        # The bounds are a vector over the rank's parameters, MAX-reduced over the stage: under EP the same slot
        # holds another expert on each EP rank, so a bound would mix experts and differ from one process's.
        errs.append(
            f"{' '.join(f + ' fp16' for f in fp16)} with --expert-model-parallel-size "
            f"{cfg.parallel.expert_model_parallel_size}: fp16 moments' per-tensor bounds are not kept per expert across "
            "expert-parallel ranks; use bf16 moments (--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) with expert parallelism"
        )
    if t.fp8_param_gather and t.main_params_dtype != "fp32":
        errs.append(
            f"--fp8-param-gather needs --main-params-dtype fp32: the FP8 weights are cast from the fp32 master, their "
            f"source of truth (not --main-params-dtype {t.main_params_dtype})"
        )
    return errs


# ---------------------------------------------------------------- rounding


def random_bits(index: torch.Tensor, key: int) -> torch.Tensor:
    """32 random bits (in int64) per int64 ``index`` (< 2^32), determined by (key, index) only: a multiplicative
    hash of index XOR key. For one element, as the key varies over steps (mix_seed, a full 64-bit
    mix), index XOR key is uniform and multiplying by an odd constant mod 2^32 is a bijection, so the bits are
    uniform: each rounding is unbiased. Across the elements of one step they form a low-discrepancy sequence,
    which only evens the rounding out. Three integer operations per element."""
    return ((index ^ (key & _M32)) * _MUL) & _M32


def uniform(index: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 numbers in [0, 1) on a 2^-24 grid, one per int64 ``index`` (< 2^32), determined by (key, index) only."""
    return (random_bits(index, key) >> 8).to(torch.float32) * 2.0**-24


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) in bf16, stochastically: 16 random ``bits`` added below bf16's last mantissa bit, then cut off.
    The carry reaches the last bit with probability (the cut part) / 2^16: the neighbour away from zero with
    probability equal to the distance from the one toward zero over their spacing (either sign: the addition acts
    on the magnitude's bit pattern). The sum cannot overflow int32 (finite floats' patterns stay below 2^31 from
    either end); an inf stays inf."""
    summed = x.view(torch.int32) + (bits >> 16).to(torch.int32)  # the hash's high bits are its best
    return (summed & -65536).view(torch.float32).to(torch.bfloat16)  # -65536: 0xFFFF0000 as int32


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, u: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) in ``dtype``: the neighbour above |x| with probability (distance to the one below) / (their
    spacing), decided by ``u`` in [0, 1); values the dtype holds exactly, and non-finite ones, are kept. Unbiased:
    E[result] = x. (bf16 masters take stochastic_round_bf16, the same rule in three integer operations.)"""
    nearest = x.to(dtype)
    near = nearest.float()
    toward = torch.where(near < x, float("inf"), float("-inf")).to(dtype)
    other = torch.nextafter(nearest, toward).float()  # the neighbour on x's other side
    gap = other - near
    p_other = torch.where(gap != 0, (x - near) / gap, 0.0)  # in [0, 1/2]: nearest is the likelier one
    return torch.where(u < p_other, other, near).to(dtype)


@dataclass(frozen=True)
class KeyedRange:
    """Elements [lo, lo + rows x cols) of a flat owned range that are the rectangle at (row0, col0) of the global
    tensor named by ``name_key`` with ``global_cols`` columns (1-D: rows 1, global_cols 0)."""

    lo: int
    rows: int
    cols: int
    row0: int
    col0: int
    global_cols: int
    name_key: int

    @property
    def hi(self) -> int:
        return self.lo + self.rows * self.cols

    def index(self, k0: int, k1: int, device: torch.device) -> torch.Tensor:
        """The global flat index of the rectangle's elements k0..k1-1 (row-major): the rows they touch as a grid
        (no division per element), cut to [k0, k1)."""
        first, last = k0 // self.cols, (k1 - 1) // self.cols
        rows = torch.arange(self.row0 + first, self.row0 + last + 1, dtype=torch.int64, device=device) * self.global_cols
        cols = torch.arange(self.col0, self.col0 + self.cols, dtype=torch.int64, device=device)
        return (rows[:, None] + cols[None, :]).reshape(-1)[k0 - first * self.cols : k1 - first * self.cols]


def keyed_ranges(name: str, param: torch.Tensor, start: int, stop: int, lo: int) -> list[KeyedRange]:
    """The global coordinates of elements [start, stop) of param.view(-1), which sit at ``lo`` of a flat owned
    range: the checkpoint's own pieces (checkpoint/pieces.py; experts per expert). Vocabulary padding rows have
    no global place and are left out (they round to nearest; they never reach the loss)."""
    out = []
    for part in owned_parts(name, param, start, stop):
        key = zlib.crc32(part.name.encode())
        for piece in part.pieces:
            base = lo + part.lo + piece.lo
            if len(piece.sizes) == 1:
                out.append(KeyedRange(base, 1, piece.sizes[0], 0, piece.offsets[0], 0, key))
            else:
                rows, cols = piece.sizes
                out.append(KeyedRange(base, rows, cols, piece.offsets[0], piece.offsets[1], part.shape[1], key))
    return out


ROUNDING_CHUNK = 1 << 22  # elements rounded at once: bounds the rounding's fp32 and int64 temporaries


def stochastic_store(work: torch.Tensor, store: torch.Tensor, ranges: list[KeyedRange], seed: int, step: int) -> None:
    """``work`` (fp32) into ``store`` with stochastic rounding, each element's random number keyed by (seed, optimizer
    step, name, global index); elements no range covers round to nearest. In chunks of ROUNDING_CHUNK elements."""
    keys = {r.name_key: mix_seed(seed, step, r.name_key) for r in ranges}
    bf16 = store.dtype == torch.bfloat16
    for a in range(0, work.numel(), ROUNDING_CHUNK):
        b = min(a + ROUNDING_CHUNK, work.numel())
        # Uncovered elements round to nearest: half the carry (bits 2^31, of which bf16 adds the high 16: 2^15; ties go
        # away from zero) or u = 1/2.
        rnd = torch.full((b - a,), 1 << 31 if bf16 else 0.5, dtype=torch.int64 if bf16 else torch.float32, device=work.device)
        for r in ranges:
            lo, hi = max(a, r.lo), min(b, r.hi)
            if lo < hi:
                draw = random_bits if bf16 else uniform
                rnd[lo - a : hi - a] = draw(r.index(lo - r.lo, hi - r.lo, work.device), keys[r.name_key])
        rounded = stochastic_round_bf16(work[a:b], rnd) if bf16 else stochastic_round(work[a:b], store.dtype, rnd)
        store[a:b].copy_(rounded)


# ---------------------------------------------------------------- fp16 moments: per-parameter scales


def moment_scale(bound: torch.Tensor) -> torch.Tensor:
    """The power of two that brings a moment bounded by ``bound`` just inside fp16's range (fp8.scale_for's rule)."""
    return scale_for(bound, torch.float16)


def to_storage(work: torch.Tensor, store: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
    """fp32 ``work`` into ``store``'s dtype, to nearest; fp16 moments multiplied by their power-of-two ``scale``
    first (exact), clamped to the largest finite fp16 (a bound exceeded by rounding, never by more)."""
    if scale is None:
        store.copy_(work)
        return
    top = torch.finfo(torch.float16).max
    store.copy_((work * scale).clamp_(-top, top))


def from_storage(store: torch.Tensor, work: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
    """``store`` widened into fp32 ``work`` (unscaled: an exact division by a power of two)."""
    work.copy_(store)
    if scale is not None:
        work.div_(scale)
