"""Worker: context-parallel attention equals torch's causal SDPA on the whole sequence, forward and backward.

Each rank holds its two load-balanced chunks of q, k, v (GQA: 2 key/value heads for 4 query heads);
its output and its q, k, v gradients must equal the single-device ones at its positions. Float64
throughout (gloo all-gathers and reduce-scatters float64), so the comparison does not depend on the
CPU's summation order: see REL. Prints "ok" on success.
"""

import torch
import torch.distributed as dist

from tricorn.model.spec import sdpa_causal
from tricorn.parallel.context import context_parallel_attention, local_positions

dist.init_process_group("gloo")
group = dist.group.WORLD
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same full tensors on every rank
# Each value is a softmax-weighted sum over <= 32 keys of d=8 products of O(1) randn terms; reordering
# (the gathered key order, the masked vs causal kernel) errs by <= N * 1.1e-16 * sum|terms| ~ 1e-13 of
# the largest value. 1e-10 of it leaves 1000x room on any CPU; a wrong mask or chunk is O(1) off.
REL = 1e-10

b, heads, groups, s, d = 2, 4, 2, 32, 8
q_full = torch.randn(b, heads, s, d, dtype=torch.float64, requires_grad=True)
k_full = torch.randn(b, groups, s, d, dtype=torch.float64, requires_grad=True)
v_full = torch.randn(b, groups, s, d, dtype=torch.float64, requires_grad=True)
grad_full = torch.randn(b, heads, s, d, dtype=torch.float64)
ref = sdpa_causal(q_full, k_full, v_full, None)  # no dropout
ref.backward(grad_full)

idx = local_positions(s, rank, world)
q, k, v = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q_full, k_full, v_full))
out = context_parallel_attention(group, s // world)(q, k, v, None)  # no dropout
out.backward(grad_full[:, :, idx])


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float64, (name, got.dtype)
    scale = max(want.abs().max().item(), 1.0)  # the magnitude of the terms (randn: O(1))
    torch.testing.assert_close(got, want, rtol=REL, atol=REL * scale, msg=lambda m: f"rank {rank} {name}: {m}")


check("output", out, ref[:, :, idx])
check("q grad", q.grad, q_full.grad[:, :, idx])
check("k grad (reduce-scattered over CP)", k.grad, k_full.grad[:, :, idx])
check("v grad (reduce-scattered over CP)", v.grad, v_full.grad[:, :, idx])
dist.barrier()  # exit together: a rank leaving mid-collective aborts gloo on its peers
dist.destroy_process_group()
print("ok")
