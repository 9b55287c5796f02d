"""Which CUDA kernel torch 2.13's scaled_dot_product_attention would run for given inputs: a pure function.

No GPU is lent to CI, so "attention runs flash (or the memory-efficient kernel) on CUDA" is checked on
the CPU: tricorn.host_reads records every SDPA call of a training iteration as an `AttentionCall`
(shapes, strides, dtypes, mask, dropout, causal, GQA, whether autograd records it), and
`cuda_sdpa_kernel` replays torch's CUDA selection rules on it for a given compute capability.

The rules follow torch's own filters, one function here per backend, each check named after torch's:

- aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``select_sdp_backend``: try the backends in
  ``priority_order`` (aten/src/ATen/Context.h ``sdp_priority_order``: flash, efficient, math, cuDNN - so cuDNN
  is never reached - unless ``check_prefer_cudnn_attention`` moves cuDNN first: sm90/sm10x with cuDNN > 9.15),
  take the first whose ``can_use_*`` accepts the inputs.
- ``can_use_flash_attention``: ``check_tensor_shapes`` (4-D), ``check_for_attn_mask`` (no mask at all),
  ``check_head_dim_size_flash`` (q, k, v last dims equal and <= 256), ``check_flash_attention_hardware_support``
  (sm80..sm121), ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120`` (training on
  sm86-89/sm120-121: head dim <= 192, or > 224 without dropout), ``check_flash_causal_non_square_seqlens``
  (is_causal needs s_q == s_k), ``check_dtypes_flash_attention`` / ``check_dtypes_low_precision`` (fp16, bf16),
  and for dense inputs ``check_batch_size_and_num_heads_dense`` (same batch; heads equal, or with enable_gqa
  ``check_grouped_query_attention``: k heads == v heads and q heads % k heads == 0),
  ``check_nonzero_sequence_lengths_dense``, ``check_last_dim_stride_equals_1_dense`` (singleton dim ignored).
  Dropout is accepted.
- ``can_use_mem_efficient_attention``: ``check_mem_efficient_hardware_support`` (sm50..sm121),
  ``check_tensor_shapes``, ``check_head_dim_size_mem_efficient`` (q, k last dims equal; q and v last dims
  multiples of ``minimum_gemm_alignment``: 8 for fp16/bf16 and 4 for fp32 on sm80+),
  ``check_data_ptr_alignment_mem_efficient`` (sm80+: storage offset * element size a multiple of that alignment
  in bytes), dense: nonzero lengths, last-dim stride 1 (singleton not ignored), same batch and heads; dtypes
  fp16/fp32/bf16 on sm80+ (fp16/fp32 below). Masks and dropout are accepted. GQA: torch 2.13 documents
  (torch/nn/functional.py, scaled_dot_product_attention's docstring) that "GQA ... currently works only for
  Flash_attention and math kernel on CUDA", i.e. ``check_batch_size_and_num_heads_dense<false>``: different
  head counts are refused. Newer torch main (sdp_utils.cpp at 21c3369e) accepts GQA here: `efficient_gqa=True`.
- ``can_use_cudnn_attention``: ``check_dtypes_low_precision``, ``check_attn_mask_shape`` (2-D or 4-D
  broadcastable, no grad), ``check_cudnn_hardware_support`` (sm80..sm121), ``check_cudnn_dropout`` (multiples
  of 1/16), ``check_cudnn_tensor_shapes`` (batch and heads <= 65535, head dims multiples of 8 and <= 128, 256 on
  sm90/sm10x with cuDNN > 9.22), GQA accepted, kv length != 1.
- math: always (it materialises [b, h, s_q, s_k] scores in fp32; with GQA it repeats k, v first).

Source: pytorch/pytorch sdp_utils.cpp at 21c3369e and sdp_utils_cpp.h; read for this module, not copied.
Not modelled: nested tensors, ROCm, FA3 (fp8), runtime-disabled backends (sdpa_kernel contexts), determinism.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
FUSED = (FLASH, EFFICIENT)
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionCall:
    """What torch's kernel choice looks at in one scaled_dot_product_attention call."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    last_strides: tuple[int, int, int]
    offset_bytes: tuple[int, int, int]  # storage offset * element size of q, k, v
    mask: Optional[tuple[int, ...]] = None  # attn_mask's shape, None without a mask
    mask_requires_grad: bool = False
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = False  # grad mode on and q, k or v requires grad (a training forward)
    where: str = "?"
    varlen: bool = False  # aten._flash_attention_forward on packed whole sequences (tricorn/model/varlen.py)

    @classmethod
    def of(cls, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, where="?") -> AttentionCall:
        qkv = (q, k, v)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in qkv)
        return cls(
            tuple(q.shape),
            tuple(k.shape),
            tuple(v.shape),
            (q.dtype, k.dtype, v.dtype),
            tuple(t.stride(-1) for t in qkv),
            tuple(t.storage_offset() * t.element_size() for t in qkv),
            None if attn_mask is None else tuple(attn_mask.shape),
            attn_mask is not None and attn_mask.requires_grad,
            float(dropout_p),
            bool(is_causal),
            bool(enable_gqa),
            grad,
            where,
        )

    def scores_bytes(self) -> int:
        """fp32 [b, h, s_q, s_k]: what the math kernel materialises (and as much again for the softmax)."""
        b, h, s_q, _ = self.q
        return b * h * s_q * self.k[2] * 4


def _sm(cap: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    return lo <= tuple(cap) <= hi


def _dense_common(c: AttentionCall, ignore_singleton: bool, gqa: bool) -> Optional[str]:
    """check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense, check_batch_size_and_num_heads_dense."""
    if c.q[2] == 0 or c.k[2] == 0:
        return "zero sequence length"
    if not all(s == 1 for s in c.last_strides) and not (ignore_singleton and c.q[3] == 1):
        return "last dimension not contiguous"
    if not c.q[0] == c.k[0] == c.v[0]:
        return "batch sizes differ"
    if c.enable_gqa and gqa:
        if c.k[1] != c.v[1] or c.q[1] % c.k[1]:
            return "GQA needs k heads == v heads dividing q heads"
        return None
    if not c.q[1] == c.k[1] == c.v[1]:
        return "head counts differ" + (" (GQA not supported by this kernel)" if c.enable_gqa else "")
    return None


def _dtype_ok(c: AttentionCall, allowed: tuple[torch.dtype, ...]) -> bool:
    return c.dtypes[0] == c.dtypes[1] == c.dtypes[2] and c.dtypes[0] in allowed


def flash_refusal(c: AttentionCall, cap: tuple[int, int]) -> Optional[str]:
    """None when can_use_flash_attention accepts the call, else why not."""
    if not (len(c.q) == len(c.k) == len(c.v) == 4):
        return "inputs not 4-D"
    if c.mask is not None:
        return "attn_mask given (flash takes none)"
    if not (c.q[3] == c.k[3] == c.v[3] and c.q[3] <= 256):
        return "head dims differ or exceed 256"
    if not _sm(cap, (8, 0), (12, 1)):
        return f"sm{cap[0]}{cap[1]} outside sm80..sm121"
    if c.requires_grad and (_sm(cap, (8, 6), (8, 9)) or _sm(cap, (12, 0), (12, 1))):
        if not (c.q[3] <= 192 or (c.dropout == 0.0 and c.q[3] > 224)):
            return "training head dim in (192, 224] on sm86-89/sm120"
    if c.is_causal and c.q[2] != c.k[2]:
        return "is_causal with s_q != s_k"
    if not _dtype_ok(c, HALF if cap[0] >= 8 else (torch.float16,)):
        return f"dtype {c.dtypes[0]} (flash needs fp16/bf16)"
    return _dense_common(c, ignore_singleton=True, gqa=True)


def _gemm_alignment(c: AttentionCall, cap: tuple[int, int]) -> int:
    """minimum_gemm_alignment: elements, from the tensor-core tile width."""
    half = c.dtypes[0] in HALF
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    align = 4 if cap[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def efficient_refusal(c: AttentionCall, cap: tuple[int, int], efficient_gqa: bool = False) -> Optional[str]:
    """None when can_use_mem_efficient_attention accepts the call, else why not."""
    if not _sm(cap, (5, 0), (12, 1)):
        return f"sm{cap[0]}{cap[1]} outside sm50..sm121"
    if not (len(c.q) == len(c.k) == len(c.v) == 4):
        return "inputs not 4-D"
    align = _gemm_alignment(c, cap)
    if not (c.q[3] == c.k[3] and c.q[3] % align == 0 and c.v[3] % align == 0 and c.q[3] > 0 and c.v[3] > 0):
        return f"head dims not equal multiples of {align}"
    if cap[0] >= 8:
        elem = {torch.float32: 4}.get(c.dtypes[0], 2)
        if any(off % (align * elem) for off in c.offset_bytes):
            return "storage offset misaligned"
    refusal = _dense_common(c, ignore_singleton=False, gqa=efficient_gqa)
    if refusal:
        return refusal
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cap[0] >= 8 else (torch.float16, torch.float32)
    return None if _dtype_ok(c, allowed) else f"dtype {c.dtypes[0]}"


def cudnn_refusal(c: AttentionCall, cap: tuple[int, int], head_dim_limit: int = 128) -> Optional[str]:
    """None when can_use_cudnn_attention accepts the call (cuDNN >= 9), else why not."""
    if not (len(c.q) == len(c.k) == len(c.v) == 4):
        return "inputs not 4-D"
    if not _dtype_ok(c, HALF):
        return f"dtype {c.dtypes[0]}"
    if c.mask is not None and (c.mask_requires_grad or len(c.mask) not in (2, 4)):
        return "mask shape or grad"
    if not _sm(cap, (8, 0), (12, 1)):
        return f"sm{cap[0]}{cap[1]} outside sm80..sm121"
    if c.dropout * 16 != int(c.dropout * 16):
        return "dropout not a multiple of 1/16"
    refusal = _dense_common(c, ignore_singleton=True, gqa=True)
    if refusal:
        return refusal
    if c.q[0] > 65535 or c.q[1] > 65535:
        return "batch or heads > 65535"
    if c.q[3] > head_dim_limit or c.v[3] > head_dim_limit or c.q[3] % 8 or c.v[3] % 8:
        return f"head dim not a multiple of 8 up to {head_dim_limit}"
    return "kv length 1" if c.k[2] == 1 else None


def varlen_refusal(c: AttentionCall, cap: tuple[int, int]) -> Optional[str]:
    """None when ``aten._flash_attention_forward`` takes these whole sequences packed as varlen (torch 2.13's flash
    mha_varlen_fwd checks, as for dense flash less the layout ones: the packed tensors are made to fit), else why
    not: fp16 / bf16, sm80..sm121, equal head dims up to 256 (the training limit on sm86-89 / sm120 included),
    k heads == v heads dividing q heads. No mask, no dropout: the caller's window and documents are its arguments."""
    if not _sm(cap, (8, 0), (12, 1)):
        return f"sm{cap[0]}{cap[1]} outside sm80..sm121"
    if not _dtype_ok(c, HALF):
        return f"dtype {c.dtypes[0]} (flash needs fp16/bf16)"
    if not (c.q[3] == c.k[3] == c.v[3] and c.q[3] <= 256):
        return "head dims differ or exceed 256"
    if c.requires_grad and (_sm(cap, (8, 6), (8, 9)) or _sm(cap, (12, 0), (12, 1))) and 192 < c.q[3] <= 224:
        return "training head dim in (192, 224] on sm86-89/sm120"
    if c.k[1] != c.v[1] or c.q[1] % c.k[1]:
        return "GQA needs k heads == v heads dividing q heads"
    return None


def cuda_sdpa_kernel(
    c: AttentionCall, cap: tuple[int, int] = (9, 0), prefer_cudnn: bool = False, efficient_gqa: bool = False
) -> str:
    """The backend select_sdp_backend picks: the first of priority_order whose filters pass (math last). A varlen
    call (tricorn's own, not SDPA) runs flash or fails: math stands for the failure."""
    if c.varlen:
        return FLASH if varlen_refusal(c, cap) is None else MATH
    # aten/src/ATen/Context.h sdp_priority_order: flash, efficient, math, cudnn (math accepts everything, so cuDNN
    # is reached only when check_prefer_cudnn_attention moved it first: sm90/sm10x with cuDNN > 9.15).
    order = (CUDNN, FLASH, EFFICIENT) if prefer_cudnn else (FLASH, EFFICIENT)
    refusals = {
        FLASH: lambda: flash_refusal(c, cap),
        EFFICIENT: lambda: efficient_refusal(c, cap, efficient_gqa),
        CUDNN: lambda: cudnn_refusal(c, cap),
    }
    return next((b for b in order if refusals[b]() is None), MATH)


def fused_refusals(c: AttentionCall, cap: tuple[int, int] = (9, 0)) -> dict[str, Optional[str]]:
    """Why flash and the efficient kernel each refuse `c` (None: accepted)."""
    return {FLASH: flash_refusal(c, cap), EFFICIENT: efficient_refusal(c, cap)}


def cp_block_call(c: AttentionCall, cap: tuple[int, int] = (9, 0)) -> AttentionCall:
    """The call tricorn/parallel/context/blocks.py makes on CUDA for one block of CP attention, given the block's
    q, k, v (``c``, GQA as enable_gqa): ``aten._scaled_dot_product_flash_attention`` as is (GQA native) when
    flash takes it, else ``aten._scaled_dot_product_efficient_attention`` on k, v repeated to q's heads (fresh,
    contiguous tensors). Either op runs its own kernel or fails - neither falls back to math - so
    ``cuda_sdpa_kernel`` of the result names the kernel that runs (or math: the op would refuse)."""
    if flash_refusal(c, cap) is None:
        return c
    b, heads = c.q[0], c.q[1]
    return dataclasses.replace(
        c,
        k=(b, heads, *c.k[2:]),
        v=(b, heads, *c.v[2:]),
        last_strides=(c.last_strides[0], 1, 1),
        offset_bytes=(c.offset_bytes[0], 0, 0),
        enable_gqa=False,
    )


# The CPU op CP blocks run (tricorn/parallel/context/blocks.py): tricorn.host_reads records each call as the call
# ``cp_block_call`` says blocks.py makes on CUDA.
CP_CPU_BLOCK_OPS = (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)


def masked_block_call(cfg) -> AttentionCall:
    """The largest call a document-masked or windowed layer makes on CUDA (tricorn/model/masking.py): a square causal
    block of a whole document at this rank's heads (an unmasked block is the same call without is_causal)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    heads, kv = m.num_attention_heads // tp, max(m.kv_heads // tp, 1)
    s = m.seq_length // cp if cp > 1 and p.cp_comm_type != "a2a" else m.seq_length
    if cp > 1 and p.cp_comm_type == "a2a":
        heads, kv = heads // cp, max(kv * (cp // math.gcd(kv, cp)) // cp, 1)
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    shape = (1, heads, s, m.head_dim)
    call = AttentionCall(shape, (1, kv, s, m.head_dim), (1, kv, s, m.head_dim), (dtype,) * 3, (1, 1, 1), (0, 0, 0))
    return dataclasses.replace(call, is_causal=True, enable_gqa=kv != heads)


def masked_attention_refusal(cfg, cap: tuple[int, int] = (9, 0)) -> Optional[str]:
    """One line when --reset-attention-mask / --window-size cannot run on a CUDA device of capability `cap`: their
    blocks call flash or the efficient kernel explicitly (no math fallback, which would build the scores); whole
    sequences in fp16 / bf16 run varlen flash where it takes them, else the blocks."""
    if not (cfg.data.reset_attention_mask or cfg.model.attention_window is not None):
        return None
    block = masked_block_call(cfg)
    if block.q[2] == cfg.model.seq_length and varlen_refusal(block, cap) is None:
        return None
    call = cp_block_call(block, cap)
    if cuda_sdpa_kernel(call, cap) in FUSED:
        return None
    refusal = fused_refusals(call, cap)
    return (
        f"--reset-attention-mask / --window-size need flash or the efficient attention kernel on this GPU (sm{cap[0]}{cap[1]}, "
        f"{cfg.param_dtype_name}, head dim {cfg.model.head_dim}): flash refuses: {refusal[FLASH]}; efficient refuses: "
        f"{refusal[EFFICIENT]}; use --bf16 or a head dimension that is a multiple of 8"
    )


def math_fallback_warning(cfg, cap: tuple[int, int] = (9, 0)) -> Optional[str]:
    """One line when this config's attention can only run torch's math kernel on a CUDA device of compute
    capability `cap`, naming its memory (the caller asks only for CUDA runs)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    if m.attention_dropout:  # dropout runs tricorn's explicit form (model/dropout.py), not SDPA
        return None
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    heads, kv = m.num_attention_heads // tp, max(m.kv_heads // tp, 1)
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    b, s, d = t.micro_batch_size, m.seq_length, m.head_dim
    if cp > 1 and p.cp_comm_type == "a2a":  # parallel/context/ulysses.py: the full sequence on heads / CP
        groups = max(kv * (cp // math.gcd(kv, cp)) // cp, 1)
        heads, kv = heads // cp, groups
    elif cp > 1:  # parallel/context/blocks.py: one block per call, s/CP rows (causal on square blocks)
        s = s // cp
    call = AttentionCall(
        (b, heads, s, d), (b, kv, s, d), (b, kv, s, d), (dtype,) * 3, (1, 1, 1), (0, 0, 0), is_causal=True, enable_gqa=kv != heads
    )
    if cp > 1 and p.cp_comm_type != "a2a":
        call = cp_block_call(call, cap)
    if cuda_sdpa_kernel(call, cap) != MATH:
        return None
    refusal = fused_refusals(call, cap)
    gib = call.scores_bytes() / 2**30
    return (
        f"attention runs torch's math kernel on CUDA ({cfg.param_dtype_name}, {heads} query / {kv} key-value heads: "
        f"flash refuses: {refusal[FLASH]}; efficient refuses: {refusal[EFFICIENT]}): fp32 scores [b, h, s, s] of "
        f"{gib:.2f} GiB per layer and microbatch, twice that with the softmax kept for backward; use --bf16"
    )
