"""DDP gradient buckets: bucket planning and sizing, gradients accumulated in the buffers in place, overlap of the
reduction with backward, and equivalence to one process."""

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distopt_common import MBS1, reference_extra
from harness import BASE_FLAGS, assert_equivalent, run_script
from torch import nn

from tricorn.config import MIN_BUCKET_ELEMENTS, ModelConfig, default_bucket_elements
from tricorn.config_args import config_from_args
from tricorn.model import GPTModel
from tricorn.parallel import wgrad
from tricorn.parallel.data_parallel import Bucket, DataParallel, DPOptions, dp_options, plan_param_buckets
from tricorn.planning.layout import Layout
from tricorn.validation import validate

WORKER = Path(__file__).parent / "workers" / "dist_opt.py"


def _params(*sizes: int, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_buckets_are_reverse_order_and_close_past_the_size():
    params = _params(10, 20, 30, 40)
    buckets = plan_param_buckets(params, bucket_size=50, alone=lambda p: False)
    assert [[p.numel() for p in b] for b in buckets] == [[40, 30], [20, 10]]


def test_one_dtype_per_bucket_and_lone_params():
    params = _params(5, 5) + _params(5, dtype=torch.bfloat16) + _params(5, 5)
    buckets = plan_param_buckets(params, bucket_size=1000, alone=lambda p: p is params[0])
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b] for b in buckets] == [[4, 3], [2], [1], [0]]


def test_default_bucket_size_cuts_a_multi_layer_model():
    """Megatron's max(40M, 1M x DP) for big models, at most a quarter of a smaller chunk (so --overlap-grad-reduce
    has buckets to overlap), never below 1M elements; the memory estimator sizes buckets the same way."""
    assert default_bucket_elements(dp=8, chunk_params=6_700_000_000 // 8) == 40_000_000  # 7B, DP 8: Megatron's
    assert default_bucket_elements(dp=64, chunk_params=10**9) == 64_000_000
    assert default_bucket_elements(dp=1, chunk_params=200_000) == MIN_BUCKET_ELEMENTS  # tiny: one bucket
    model = GPTModel(
        ModelConfig(
            num_layers=4,
            hidden_size=256,
            num_attention_heads=8,
            group_query_attention=True,
            num_query_groups=2,
            swiglu=True,
            seq_length=256,
            vocab_size=8000,
            disable_bias_linear=True,
        )
    )
    params = list(model.parameters())
    size = default_bucket_elements(1, sum(p.numel() for p in params))
    assert len(plan_param_buckets(params, size, alone=lambda p: False)) >= 4  # bench/overhead.py's model, 5.9M parameters
    assert Layout(dp=2, cp=2).bucket_elements(10**8) == default_bucket_elements(4, 10**8)
    assert Layout(dp=2, ddp_bucket_elements=123).bucket_elements(10**8) == 123


@pytest.fixture
def one_rank():
    """A gloo group of this one process: DataParallel's state (its reductions send nothing)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.group.WORLD
    yield SimpleNamespace(dp_cp_group=world, device=torch.device("cpu"), embedding_group=None, replica_group=lambda _: world)
    dist.destroy_process_group()


class _Net(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False, dtype=dtype)
        self.b = nn.Linear(8, 8, dtype=dtype)
        self.unused = nn.Parameter(torch.ones(3, dtype=dtype))  # gets no gradient: its slot must read 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize(
    "dtype, stage", [(torch.float32, 0), (torch.float32, 1), (torch.bfloat16, 0), (torch.float32, 2)], ids=str
)
def test_gradients_land_in_the_buffers_without_a_zeroing_pass(one_rank, monkeypatch, dtype, stage):
    """Buffers full of garbage (NaN) before each iteration still give exactly a plain model's gradients summed
    over 2 microbatches in fp32: each slot's first gradient is written, later ones added, unused slots zeroed.
    fp32 parameters (stages 0-1) then have p.grad = their buffer slot, into which autograd accumulates."""
    fresh = Bucket.grad_accumulator

    def garbage(bucket: Bucket) -> torch.Tensor:  # ZeRO-2's transient buffer comes from torch.empty: stale bytes
        new = bucket.grad_flat is None
        out = fresh(bucket)
        if new:
            out[: bucket.slots[-1].end].fill_(float("nan"))
        return out

    monkeypatch.setattr(Bucket, "grad_accumulator", garbage)
    torch.manual_seed(0)
    model = _Net(dtype)
    ref = copy.deepcopy(model)
    dp = DataParallel(model, one_rank, DPOptions(stage=stage, bucket_size=70))  # 64 + 8 + 8 + 3: two buckets
    assert len(dp.buckets) == 2
    for _ in range(2):
        dp.zero_grad()
        for p in model.parameters():
            p.grad = None  # as Optimizer.zero_grad
        for b in dp.buckets:
            if b.grad_flat is not None:  # stages 0-1: whatever the last iteration left (ZeRO-1: partial sums)
                b.grad_flat[: b.slots[-1].end].fill_(float("nan"))
        want = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
        for i in range(2):
            x = torch.randn(4, 8, dtype=dtype)
            with dp.microbatch(is_last=i == 1):
                model(x).sum().backward()
            ref.zero_grad()
            ref(x).sum().backward()
            for n, p in ref.named_parameters():
                want[n] += p.grad.float() if p.grad is not None else 0.0
        dp.finish_grad_sync()
        owned = dp.owned_grads()
        for n, p in model.named_parameters():
            # The same kernels on the same inputs, and the same fp32 sum of two microbatches: equal bits.
            assert torch.equal(owned[id(p)].float(), want[n].reshape(-1)), n
            in_place = stage < 2 and dtype == torch.float32 and n != "unused"
            assert (p.grad is not None and p.grad.data_ptr() == owned[id(p)].data_ptr()) == in_place, n


@pytest.mark.parametrize(
    "flags, stage",
    [
        ([], 0),
        (["--use-distributed-optimizer"], 1),
        (["--zero-stage", "2"], 2),  # implies the distributed optimizer
        (["--use-distributed-optimizer", "--zero-stage", "3"], 3),
    ],
)
def test_stage_from_flags(flags, stage):
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", *flags], world_size=2)
    assert dp_options(cfg).stage == stage


def test_param_gather_overlap_needs_the_distributed_optimizer():
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", "--overlap-param-gather"], world_size=2)
    assert any("--overlap-param-gather needs --use-distributed-optimizer" in e for e in validate(cfg))
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", "--overlap-param-gather", "--zero-stage", "2"], world_size=2)
    assert validate(cfg) == [] and dp_options(cfg).overlap_param_gather


def test_overlap_starts_reductions_during_backward():
    """Event trace per bucket: first reduction before the last gradient with --overlap-grad-reduce, after it without,
    and none during the first of two microbatches (DDP and ZeRO-1)."""
    assert run_script(WORKER, 2, ["trace"]).strip().endswith("ok")


@pytest.mark.parametrize(
    "nproc, flags, extra",
    [
        (2, BASE_FLAGS, ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]),
        (4, MBS1, []),
    ],
    ids=["dp2_overlap_buckets", "dp4"],
)
def test_ddp_equals_one_process(tmp_path, tmp_path_factory, nproc, flags, extra):
    assert_equivalent(flags, nproc, tmp_path, extra, reference_extra=reference_extra(tmp_path_factory, flags))


def test_zero2_and_zero3_peak_gradient_memory():
    """DP=4: the peak of live gradient storage during backward is at most full/DP + 2 buckets (ZeRO-2 and 3)."""
    out = run_script(WORKER, 4, ["peak"], timeout=600)
    assert out.strip().endswith("ok"), out


class _Deferred(nn.Module):
    """Two linears whose weight gradients a zero-bubble W computes (wgrad.py), then a norm weight whose gradient the B
    computes, as a norm's: three buckets at bucket size 8, in backward order norm, b, a."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.norm = nn.LayerNorm(8, bias=False)  # registered last: its bucket comes first in backward order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return wgrad.linear(wgrad.linear(x, self.a.weight), self.b.weight) * self.norm.weight


def test_last_weight_pass_starts_each_bucket_from_its_own_hook(one_rank):
    """Issue 30: with --overlap-grad-reduce the last W of a chunk delivers only the deferred weights, so a bucket
    whose gradients all came in the B's is complete at once and one of deferred weights when its weight
    arrives: each starts reducing from that hook, before the W is over (without ``expected`` the norm's bucket
    would wait for a gradient the W never brings, and hold every later one back to the end) - and the gradients
    are a plain backward's (the same products accumulated in the same order, bitwise)."""
    torch.manual_seed(0)
    model = _Deferred()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, one_rank, DPOptions(stage=0, bucket_size=8, overlap_grad_reduce=True))
    assert len(dp.buckets) == 3
    xs = [torch.randn(4, 8) for _ in range(2)]
    store = wgrad.WeightGradStore()
    dp.trace = []
    with store.collecting():
        for i, x in enumerate(xs):  # the B's: the norm's gradient now, the weights' queued
            with dp.microbatch(is_last=False), store.backward_input((i, 0)):
                model(x).sum().backward()
        with dp.microbatch(is_last=False):
            store.run((0, 0))
        with dp.microbatch(is_last=True, expected=store.weights((1, 0))):
            store.run((1, 0))
    kinds = [k for k, _ in dp.trace]
    grads_in_last_w = [i for i, k in enumerate(kinds) if k == "grad"][-2:]
    launches = [i for i, k in enumerate(kinds) if k == "launch"]
    # The norm's bucket (complete since the B's) starts as the W begins, b's at b's gradient, before a's arrives.
    assert len(launches) == 3 and launches[0] < grads_in_last_w[0] < launches[1] < grads_in_last_w[1], kinds
    dp.finish_grad_sync()
    for x in xs:
        ref(x).sum().backward()
    owned = dp.owned_grads()
    for n, p in model.named_parameters():
        assert torch.equal(owned[id(p)], dict(ref.named_parameters())[n].grad.reshape(-1)), n
