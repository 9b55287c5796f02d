"""Worker: the pipeline executor on real model chunks, one pipeline of WORLD_SIZE ranks.

For each case (schedule, chunks per rank, microbatches, tied or not, forward-only or not) it
checks on every rank:
- the loss and every parameter gradient equal one process running the whole model on the
  same microbatches (both in float64: see GRAD_REL), the loss scale applied exactly once, the tied embedding and head
  copies equal after grads.reduce_tied_embedding_grads;
- the executor ran its actions in the simulator's order and held as many microbatch
  outputs as the simulator predicts;
- optimizer.microbatch(is_last, chunk) wrapped every backward, is_last only on each chunk's last
  (zero-bubble schedules: every B and every W, is_last only on each chunk's last W);
- the P2P bytes sent are the activation size times the number of sends;
- zero-bubble schedules (built with the tensor-parallel spec, whose linears and norms defer their
  weight gradients) ran W's that computed every linear's and norm's weight gradient, and zb-h1's
  gradients equal 1F1B's bit for bit: same stages, and every parameter accumulates its
  microbatches in the same order 0..m-1.
Prints "ok" on success.
"""

import contextlib
import os

import torch
import torch.distributed as dist

from tricorn.config_args import config_from_args
from tricorn.data.base import Batch
from tricorn.model.transformer import GPTModel
from tricorn.parallel.grads import reduce_tied_embedding_grads
from tricorn.parallel.pipeline.build import build_model_chunks
from tricorn.parallel.pipeline.executor import PipelineExecutor
from tricorn.parallel.pipeline.schedules import (
    SEND_FORWARD,
    V_SCHEDULES,
    WEIGHT,
    ZERO_BUBBLE,
    group_steps,
    placement_of,
    schedule_for,
)
from tricorn.parallel.pipeline.simulator import simulate
from tricorn.parallel.state import init_parallel
from tricorn.parallel.step import StepContext
from tricorn.parallel.tensor import tensor_parallel_spec
from tricorn.validation import validate

LOSS_SCALE = 8.0  # a power of two: scaling and unscaling are exact
# Chunks, reference model and the activations on the wire are float64, so the comparison does not
# depend on the CPU's summation order. A gradient here is a sum over <= 8 microbatches x 32 tokens
# of products through <= 8 layers of width <= 128; reordering it (microbatch order, the tied
# embedding's two halves) errs by <= N * 1.1e-16 * sum|terms| ~ 1e-13 of the largest gradient of the
# tensor. 1e-10 of that leaves 1000x room on any CPU; a lost or doubled term is O(1) relative.
GRAD_REL = 1e-10
# The executor sums the microbatch losses in fp32 (as the trainer logs them): <= 8 positive addends,
# each rounded to fp32 and added in fp32, err by <= 8 * 6e-8 = 4.8e-7 of the sum in the worst case.
LOSS_REL = 1e-6
WORLD = int(os.environ["WORLD_SIZE"])


class RecordingOptimizer:
    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    @contextlib.contextmanager
    def microbatch(self, is_last: bool, chunk: int, expected=None):
        self.calls.append((chunk, is_last))
        yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * LOSS_SCALE


def check(what: str, got: torch.Tensor, want: torch.Tensor, **tol) -> None:
    torch.testing.assert_close(got, want, **tol, msg=lambda s: f"{what}: {s}")


def make_microbatches(cfg, m: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(7)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (m, b, s + 1), generator=gen)
    mask = (torch.rand(m, b, s, generator=gen) > 0.2).float()  # masked positions must not count anywhere
    return [Batch(t[:, :-1], t[:, 1:], k) for t, k in zip(tokens, mask)]


def reference(cfg, mbs: list[Batch], num_tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = GPTModel(cfg.model, padded_vocab_size=cfg.model.padded_vocab_size(1))
    model.init_weights(cfg.training.seed)
    model.double()
    total = 0.0
    for mb in mbs:
        loss = (model(mb.tokens, mb.labels) * mb.loss_mask).sum() / num_tokens
        loss.backward()
        total += loss.item()
    return total, dict(model.named_parameters()), {n: p.grad for n, p in model.named_parameters()}


def run_case(pp: int, vpp: int, m: int, kind, untied: bool, forward_only: bool) -> None:
    layers = max(4, pp * vpp)
    argv = (
        f"--device cpu --mock-data --vocab-size 97 --num-layers {layers} --hidden-size 32 --num-attention-heads 4 "
        f"--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size {2 * m} "
        f"--pipeline-model-parallel-size {pp} --num-virtual-stages-per-pipeline-rank {vpp}"
    ).split() + (["--untie-embeddings-and-output-weights"] if untied else [])
    if kind in ("gpipe", *ZERO_BUBBLE):
        argv += ["--pipeline-schedule", kind]
    cfg = config_from_args(argv, world_size=WORLD)
    assert not validate(cfg), validate(cfg)
    state = init_parallel(cfg)
    name = f"pp{pp} vpp{vpp} m{m} {kind or 'default'}{' untied' if untied else ''}{' forward-only' if forward_only else ''}"

    mbs = make_microbatches(cfg, m)
    num_tokens = sum(mb.loss_mask.sum() for mb in mbs)
    zero_bubble = kind in ZERO_BUBBLE
    # The tensor-parallel spec (TP 1 here) is the trainer's: its linears and norms are the ones that defer dW.
    spec = tensor_parallel_spec(cfg, state.tp_group) if zero_bubble else None

    def execute(kind_cfg):
        torch.manual_seed(0)
        chunks = [c.double() for c in build_model_chunks(kind_cfg, spec, state.pp_rank, 1, state.device)]
        executor = PipelineExecutor(kind_cfg, state)
        executor.p2p.dtype = torch.float64  # activations travel in the parameter dtype; the config has no float64
        optimizer = RecordingOptimizer()
        ctx = StepContext(optimizer, num_tokens, forward_only=forward_only)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            total = executor(chunks, mbs, ctx)
        return chunks, executor, optimizer, total

    chunks, executor, optimizer, total = execute(cfg)
    ref_total, ref_params, ref_grads = reference(cfg, mbs, num_tokens)

    # Loss: the sum of normalised microbatch losses on the last stage, zero elsewhere.
    want = ref_total if any(executor.is_last_stage(c) for c in range(vpp)) else 0.0
    assert abs(total.item() - want) <= LOSS_REL * abs(ref_total), f"{name}: rank {state.pp_rank} loss {total.item()} vs {want}"

    # The executor's order and memory are the simulator's.
    schedule = schedule_for(pp, vpp, m, None if vpp > 1 and kind not in V_SCHEDULES else kind, forward_only)
    sim = simulate(schedule, pp, vpp, placement=placement_of(kind), lazy_sends=True)
    assert not sim.deadlocked, sim.report()
    assert executor.order == sim.order[state.pp_rank], f"{name}: executor order differs from the simulator's"
    assert executor.peak_in_flight == sim.peak_in_flight[state.pp_rank], (
        f"{name}: held {executor.peak_in_flight} outputs, simulator {sim.peak_in_flight[state.pp_rank]}"
    )
    sends = sum(a.kind.is_send for a in executor.order)
    # Exact byte count: micro batch 2 x seq 16 x hidden 32 float64 (8-byte) elements per send.
    assert executor.p2p.bytes_sent == sends * 2 * 16 * 32 * 8, f"{name}: {executor.p2p.bytes_sent} bytes for {sends} sends"

    # P2P overlap: every receive but those of the first communication step was posted one step early; every
    # sent output of a training step lost its data once sent (its backward still ran: the gradients below).
    first = next((s for s in group_steps(executor.order) if not s[0].kind.is_compute), ())
    recvs = sum(not a.kind.is_compute and not a.kind.is_send for a in executor.order)
    assert executor.p2p.posted_early == recvs - sum(not a.kind.is_send for a in first), f"{name}: early receives"
    freed = 0 if forward_only else sum(a.kind is SEND_FORWARD for a in executor.order)
    assert executor.p2p.outputs_freed == freed, f"{name}: {executor.p2p.outputs_freed} outputs freed of {freed} sent"

    if forward_only:
        assert optimizer.calls == [], f"{name}: forward-only touched the optimizer"
        assert all(p.grad is None for c in chunks for p in c.parameters()), f"{name}: forward-only made gradients"
        return
    for c in range(vpp):
        flags = [last for chunk, last in optimizer.calls if chunk == c]
        calls = 2 * m if zero_bubble else m  # a B and a W per microbatch
        assert len(flags) == calls and flags[-1] and not any(flags[:-1]), f"{name}: chunk {c} is_last flags {flags}"
    if zero_bubble:
        # Per microbatch, every linear's and norm's weight waits for its W (the embeddings' and the biases' do not).
        deferrable = sum(n.endswith("weight") and "embeddings" not in n for c in chunks for n, _ in c.named_parameters())
        assert executor.weights_deferred == m * deferrable, (
            f"{name}: {executor.weights_deferred} deferred, want {m} x {deferrable}"
        )
        assert sum(a.kind is WEIGHT for a in executor.order) == m * vpp
    if kind == "zb-h1":
        one_f_one_b = config_from_args([a if a != "zb-h1" else "1f1b" for a in argv], world_size=WORLD)
        base, _, _, base_total = execute(one_f_one_b)
        assert torch.equal(total, base_total), f"{name}: loss differs from 1F1B's"
        for (pname, p), q in zip(chunks[0].named_parameters(), base[0].parameters()):
            assert torch.equal(p.grad, q.grad), f"{name}: rank {state.pp_rank} {pname} grad is not 1F1B's bit for bit"

    reduce_tied_embedding_grads(chunks, state, tied=not untied)
    for chunk in chunks:
        for pname, p in chunk.named_parameters():
            # A tied head copy (last stage) equals the embedding: its value and its reduced gradient.
            ref_name = "tok_embeddings.weight" if (pname == "output.weight" and not untied) else pname
            where = f"{name}: rank {state.pp_rank} {pname}"
            check(f"{where} init", p, ref_params[ref_name], rtol=0, atol=0)  # the same init, bit for bit
            want = ref_grads[ref_name]
            assert p.grad.dtype == want.dtype == torch.float64, f"{where}: grad {p.grad.dtype}"
            scale = want.abs().max().item()  # the magnitude of the terms of this tensor's gradient
            check(f"{where} grad", p.grad / LOSS_SCALE, want, rtol=GRAD_REL, atol=GRAD_REL * scale)


CASES = {
    2: [
        (2, 1, 3, "1f1b", False, False),
        (2, 1, 4, "gpipe", True, False),
        (2, 2, 4, None, False, False),
        (2, 2, 2, None, True, True),
        (2, 1, 3, "1f1b", False, True),
        (2, 1, 3, "zb-h1", True, False),
        (2, 2, 5, "zbv", True, False),
        (2, 2, 4, "dualpipev", True, False),
        (2, 2, 3, "zbv", True, True),
    ],
    4: [
        (4, 1, 6, "1f1b", True, False),
        (4, 1, 2, "1f1b", False, False),  # fewer microbatches than stages
        (4, 2, 8, None, False, False),
        (4, 1, 5, "zb-h1", False, False),
        (4, 2, 8, "dualpipev", True, False),
    ],
}

for case in CASES[WORLD]:
    run_case(*case)
dist.barrier()  # exit together: a rank leaving mid-collective aborts gloo on its peers
dist.destroy_process_group()
print("ok")
