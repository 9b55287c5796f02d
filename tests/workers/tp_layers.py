"""Worker: each tensor-parallel layer equals its single-device torch counterpart, forward and backward.

Both sides run in float64 (gloo reduces float64), so the comparison does not depend on the CPU's
summation order: see TOL.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tricorn.model.init import shard_info
from tricorn.parallel.tensor import (
    ColumnParallelLinear,
    ParallelHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence,
    vocab_parallel_cross_entropy,
)

dist.init_process_group("gloo")
group = dist.group.WORLD
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # same full tensors on every rank
torch.set_default_dtype(torch.float64)  # layers, inputs and reference all in float64
# Every compared value is a sum of at most ~100 products of O(1) randn terms (h=16, out=12, b*s=16
# rows, 37 vocabulary columns). Reordering such a sum (TP shards, gloo's reduction, the CPU's
# blocking) changes it by <= N * 1.1e-16 * sum|terms| ~ 1e-13 relative to the largest term; 1e-10
# of the largest value leaves 1000x room on any CPU, yet one wrong or missing term is ~1e10x above it.
REL = 1e-10


def shard(full: torch.Tensor, dim: int) -> torch.Tensor:
    return full.chunk(world, dim=dim)[rank].clone()


def vocab_shard(table: torch.Tensor, padded: int) -> torch.Tensor:
    """This rank's rows: torch.chunk of the real vocabulary, zero-padded to padded/world rows."""
    piece = table.chunk(world, dim=0)[rank] if rank < len(table.chunk(world, dim=0)) else table[:0]
    return torch.cat([piece, table.new_zeros(padded // world - len(piece), table.shape[1])])


def check(name, got, want):
    assert got.dtype == want.dtype == torch.float64, (name, got.dtype, want.dtype)
    scale = max(want.abs().max().item(), 1.0)  # the magnitude of the terms (randn: O(1))
    torch.testing.assert_close(got, want, rtol=REL, atol=REL * scale, msg=lambda m: f"{name}: {m}")


b, s, h, out = 2, 8, 16, 12
x_full = torch.randn(s, b, h)  # hidden states are sequence-first: SP shards dim 0
w_col, bias_col = torch.randn(out, h), torch.randn(out)
w_row, bias_row = torch.randn(h, out), torch.randn(h)
grad_out = torch.randn(s, b, h)

for sp in (False, True):
    col = ColumnParallelLinear(h, out, bias=True, group=group, sequence_parallel=sp)
    row = RowParallelLinear(out, h, bias=True, group=group, sequence_parallel=sp)
    with torch.no_grad():
        col.weight.copy_(shard(w_col, 0))
        col.bias.copy_(shard(bias_col, 0))
        row.weight.copy_(shard(w_row, 1))
        row.bias.copy_(bias_row)
    assert shard_info(col.weight).full_size == out and shard_info(row.weight).dim == 1
    x = (shard(x_full, 0) if sp else x_full.clone()).requires_grad_()
    y = row(col(x))
    y_ref_in = x_full.clone().requires_grad_()
    y_ref = F.linear(F.linear(y_ref_in, w_col, bias_col), w_row, bias_row)
    check(f"column->row forward sp={sp}", gather_from_sequence(y, group) if sp else y, y_ref)
    y.backward(shard(grad_out, 0) if sp else grad_out)
    y_ref.backward(grad_out)
    check(f"input grad sp={sp}", x.grad, shard(y_ref_in.grad, 0) if sp else y_ref_in.grad)
    w_ref = w_col.clone().requires_grad_()
    F.linear(F.linear(x_full, w_ref, bias_col), w_row, bias_row).backward(grad_out)
    check(f"column weight grad sp={sp}", col.weight.grad, shard(w_ref.grad, 0))
    bias_grad = row.bias.grad.clone()
    if sp:  # replicated bias on a sequence shard: partial grads, summed over TP by the trainer
        dist.all_reduce(bias_grad)
    check(f"row bias grad sp={sp}", bias_grad, grad_out.sum((0, 1)))

# Vocab-parallel embedding against nn.Embedding, with a vocabulary that does not divide by TP.
vocab, padded = 37, 40
table = torch.randn(vocab, h)
emb = VocabParallelEmbedding(padded, h, group=group, sequence_parallel=False, vocab_size=vocab)
with torch.no_grad():
    emb.weight.copy_(vocab_shard(table, padded))
tokens = torch.randint(0, vocab, (s, b))
ref_table = table.clone().requires_grad_()
check("embedding forward", emb(tokens), F.embedding(tokens, ref_table))
emb(tokens).backward(grad_out)
F.embedding(tokens, ref_table).backward(grad_out)
check("embedding grad", emb.weight.grad, vocab_shard(ref_table.grad, padded))

# Vocab-parallel head + cross entropy against F.cross_entropy over the real vocabulary only.
head = ParallelHead(h, padded, tied=False, group=group, sequence_parallel=False, vocab_size=vocab)
with torch.no_grad():
    head.weight.copy_(vocab_shard(table, padded))
labels = torch.randint(0, vocab, (s, b))
xh = x_full.clone().requires_grad_()
loss = vocab_parallel_cross_entropy(head(xh), labels, vocab, group)
xr = x_full.clone().requires_grad_()
ref = F.cross_entropy(F.linear(xr, table).flatten(0, 1), labels.flatten(), reduction="none").view(s, b)
check("cross entropy", loss, ref)
g = torch.rand(s, b)
loss.backward(g)
ref.backward(g)
check("cross entropy input grad", xh.grad, xr.grad)
# Attention with --qk-layernorm, --add-qkv-bias and --kv-channels against one process's: outputs, the QKV bias's
# shard, and the per-head norms' gradients, which each rank computes over its own heads only and the trainer sums
# over TP (they carry `sequence_parallel`, SP or not: tricorn/parallel/grads.py).
from tricorn.config import Config, ModelConfig, ParallelConfig  # noqa: E402
from tricorn.model.init import init_weights  # noqa: E402
from tricorn.model.spec import local_spec  # noqa: E402
from tricorn.model.transformer import Attention, rotary_of  # noqa: E402
from tricorn.parallel.tensor import tensor_parallel_spec  # noqa: E402

m = ModelConfig(hidden_size=h, num_attention_heads=8, group_query_attention=True, num_query_groups=max(2, world), kv_channels=6)
m.qk_layernorm, m.add_qkv_bias, m.disable_bias_linear, m.seq_length = True, True, True, s
rotary, positions = rotary_of(m), torch.arange(s)
one = Attention(m, local_spec())
init_weights(one, 3, 0.5, 1)
with torch.no_grad():  # non-trivial norm weights and biases (init makes them 1 and 0)
    for p in one.parameters():
        if p.dim() == 1:
            p.copy_(torch.randn(p.shape))
y_ref = one(x_full, rotary, positions)
y_ref.backward(grad_out)
for sp in (False, True):
    cfg = Config(model=m, parallel=ParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp), world_size=world)
    tp = Attention(m, tensor_parallel_spec(cfg, group))
    with torch.no_grad():
        for name, p in tp.named_parameters():
            info = shard_info(p)
            p.copy_(dict(one.named_parameters())[name] if info is None else shard(dict(one.named_parameters())[name], info.dim))
    y = tp(shard(x_full, 0) if sp else x_full, rotary, positions)
    check(f"attention forward sp={sp}", gather_from_sequence(y, group) if sp else y, y_ref)
    y.backward(shard(grad_out, 0) if sp else grad_out)
    check(f"qkv bias grad sp={sp}", tp.wqkv.bias.grad, shard(one.wqkv.bias.grad, 0))
    for norm in ("q_layernorm", "k_layernorm"):
        weight = getattr(tp, norm).weight
        assert getattr(weight, "sequence_parallel", False) == (world > 1), norm
        summed = weight.grad.clone()
        dist.all_reduce(summed)
        check(f"{norm} grad summed over TP, sp={sp}", summed, getattr(one, norm).weight.grad)

dist.barrier()  # exit together: a rank leaving mid-collective aborts gloo on its peers
dist.destroy_process_group()
print("ok")
