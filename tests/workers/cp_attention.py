"""Worker: every CP comm type's attention equals torch's causal SDPA on the whole sequence, forward and backward.

Each rank holds its two load-balanced chunks of q, k, v (MHA: 4 key/value heads; GQA: 2 for 4 query heads);
its output and its q, k, v gradients must equal the single-device ones at its positions, for p2p (ring), a2a
(Ulysses) and allgather. Float64 throughout (gloo sends, all-to-alls, gathers and reduce-scatters float64), so
the comparison does not depend on the CPU's summation order: see REL.

While each comm type runs forward and backward, a dispatch mode records the largest storage any operator
returns: it must stay below s_local x s_global elements (no [s/CP, s] mask or score tensor). The old masked
all-gather call is run under the same mode as a control, which must trip it.

Each also runs with attention dropout (GQA): equal to the single-process keyed-mask attention.

Documents and windows (tricorn/model/masking.py): every comm type, and one device's masked core, with per-sample
document bounds, a window, and both, against SDPA on the whole sequence with the explicit [b, s, s] mask in
float64; the same dispatch mode finds no storage of s_local x s elements.
Prints one JSON line {"ok": true, "largest": {...}} on rank 0.
"""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tricorn.data.documents import document_bounds, starts_from_bounds
from tricorn.model.dropout import ATTENTION_PROBS, AttentionDropout, DropoutKey
from tricorn.model.masking import AttentionMask
from tricorn.model.spec import sdpa_causal
from tricorn.parallel.context import COMM_TYPES, context_parallel_attention, local_positions

dist.init_process_group("gloo")
group = dist.group.WORLD
rank, world = dist.get_rank(), dist.get_world_size()
# Each value is a softmax-weighted sum over <= 256 keys of d=4 products of O(1) randn terms, merged over <= 2 CP
# blocks through exp/logaddexp; reordering errs by <= ~N * 1.1e-16 * sum|terms| ~ 1e-13 of the largest value in
# the worst case (~1e-15 typical). 1e-12 leaves 10x room on any CPU; a wrong block, mask or merge is O(1) off.
REL = 1e-12

b, heads, s, d = 2, 4, 256, 4  # d small: the linear tensors (full K/V: b x h x s x d) stay below s_local x s
s_local = s // world
SQUARED = s_local * s  # the [s/CP, s] mask of the old form has exactly this many elements


class LargestStorage(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                n = t.untyped_storage().nbytes() // t.element_size()
                if n > self.largest[0]:
                    self.largest = (n, str(func))
        return out


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float64, (name, got.dtype)
    scale = max(want.abs().max().item(), 1.0)  # the magnitude of the terms (randn: O(1))
    torch.testing.assert_close(got, want, rtol=REL, atol=REL * scale, msg=lambda m: f"rank {rank} {name}: {m}")


def run(comm_type: str, groups: int, dropout_p: float) -> int:
    torch.manual_seed(groups)  # the same full tensors on every rank
    # [s, b, heads, d] tensors seen as [b, heads, s, d], as the decoder passes them
    q_full, k_full, v_full = (
        torch.randn(s, b, n, d, dtype=torch.float64).permute(1, 2, 0, 3).requires_grad_() for n in (heads, groups, groups)
    )
    grad_full = torch.randn(b, heads, s, d, dtype=torch.float64)
    dropout = None
    if dropout_p:
        dropout = AttentionDropout(dropout_p, DropoutKey(7, (3, 5), 1, ATTENTION_PROBS, s), head_offset=0)
    ref = sdpa_causal(q_full, k_full, v_full, dropout)
    ref.backward(grad_full)

    idx = local_positions(s, rank, world)
    q, k, v = (
        t.detach()[:, :, idx].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3).requires_grad_()
        for t in (q_full, k_full, v_full)
    )
    core = context_parallel_attention(group, comm_type)
    mode = LargestStorage()
    with mode:
        out = core(q, k, v, dropout)
        out.backward(grad_full[:, :, idx])
    what = f"{comm_type} groups={groups} dropout={dropout_p}"
    check(f"{what} output", out, ref[:, :, idx])
    check(f"{what} q grad", q.grad, q_full.grad[:, :, idx])
    check(f"{what} k grad", k.grad, k_full.grad[:, :, idx])
    check(f"{what} v grad", v.grad, v_full.grad[:, :, idx])
    if not dropout_p:  # dropout's explicit form keeps [s/CP, s] probabilities by design (dropout.py)
        assert mode.largest[0] < SQUARED, f"rank {rank} {what}: {mode.largest} >= s_local x s = {SQUARED}"
    return mode.largest[0]


def masked_reference(q, k, v, mask: AttentionMask) -> torch.Tensor:
    """SDPA on the whole sequence with the rule's explicit [b, 1, s, s] mask (what the kernels must never build)."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i).expand(b, s, s).clone()
    if mask.documents is not None:
        allowed &= j >= starts_from_bounds(mask.documents)[:, :, None]
    if mask.window is not None:
        allowed &= j >= i - mask.window
    reps = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1), attn_mask=allowed[:, None]
    )


def run_masked(comm_type: str, groups: int, mask: AttentionMask) -> int:
    """`comm_type` "single": one device's core on the whole sequence (every rank runs it alike)."""
    torch.manual_seed(100 + groups)
    q_full, k_full, v_full = (
        torch.randn(s, b, n, d, dtype=torch.float64).permute(1, 2, 0, 3).requires_grad_() for n in (heads, groups, groups)
    )
    grad_full = torch.randn(b, heads, s, d, dtype=torch.float64)
    ref = masked_reference(q_full, k_full, v_full, mask)
    ref.backward(grad_full)
    idx = torch.arange(s) if comm_type == "single" else local_positions(s, rank, world)
    q, k, v = (
        t.detach()[:, :, idx].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3).requires_grad_()
        for t in (q_full, k_full, v_full)
    )
    core = sdpa_causal if comm_type == "single" else context_parallel_attention(group, comm_type)
    mode = LargestStorage()
    with mode:
        out = core(q, k, v, None, mask)
        out.backward(grad_full[:, :, idx])
    what = f"{comm_type} groups={groups} documents={mask.documents is not None} window={mask.window}"
    check(f"{what} output", out, ref[:, :, idx])
    check(f"{what} q grad", q.grad, q_full.grad[:, :, idx])
    check(f"{what} k grad", k.grad, k_full.grad[:, :, idx])
    check(f"{what} v grad", v.grad, v_full.grad[:, :, idx])
    assert mode.largest[0] < SQUARED, f"rank {rank} {what}: {mode.largest} >= s_local x s = {SQUARED}"
    return mode.largest[0]


largest = {}
for comm_type in COMM_TYPES:
    for groups in (heads, 2):  # MHA, GQA
        largest[f"{comm_type}/{groups}"] = run(comm_type, groups, 0.0)
for comm_type in COMM_TYPES:
    run(comm_type, 2, 0.25)

# Documents: an end-of-document token (0) about every 30 tokens, a long document in sample 1, the same on every rank.
tokens = torch.randint(1, 30, (b, s), generator=torch.Generator().manual_seed(5))
tokens[0, ::29] = 0
tokens[1, 7], tokens[1, 200] = 0, 0
documents = document_bounds(tokens, 0)
MASKS = [(4, AttentionMask(documents, 40))]  # CP4: both at once (each ring step meets all three kinds of block)
if world == 2:
    MASKS += [(2, AttentionMask(documents)), (2, AttentionMask(None, 40))]
for comm_type in ("single", *COMM_TYPES) if world == 2 else COMM_TYPES:
    for groups, mask in MASKS:
        name = f"{comm_type}/{groups}/{'documents' if mask.documents is not None else 'window'}{'+window' if mask.documents is not None and mask.window else ''}"
        largest[name] = run_masked(comm_type, groups, mask)

# The control: the old all-gather call with its [s/CP, s] boolean mask trips the same mode.
control = LargestStorage()
with control:
    qc = torch.randn(b, heads, s_local, d, dtype=torch.float64)
    kc = torch.randn(b, heads, s, d, dtype=torch.float64)
    pos = local_positions(s, rank, world)
    F.scaled_dot_product_attention(qc, kc, kc, attn_mask=torch.arange(s).unsqueeze(0) <= pos.unsqueeze(1))
assert control.largest[0] >= SQUARED, control.largest

dist.barrier()  # exit together: a rank leaving mid-collective aborts gloo on its peers
dist.destroy_process_group()
if rank == 0:
    print(json.dumps({"ok": True, "largest": largest, "squared": SQUARED}))
