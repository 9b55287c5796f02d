"""Activation offload to host (issue 43, item 3: --cpu-offloading-num-layers, tricorn/parallel/offload.py).

- Layer level, every recompute variant, fp32 and bf16: the loss and every gradient are bitwise those without
  offload; the device bytes held between forward and backward fall by exactly what the estimator sends to host
  (planning/stage_activations.py); the activation probe still counts what each layer saves.
- The CUDA contract on the CPU: under tricorn.pinned.stand_in() with recording stand-ins for torch.cuda's streams
  and events (their signatures checked against torch's), every copy between host and device is non-blocking,
  from or into pinned memory, issued on the side stream (which first waits for the compute stream); the compute
  stream waits for the side stream's events, nothing synchronizes, and the contract counter sees no read.
- The trainer (gloo ranks): zb-h1 at PP2 with selective recompute, saving at iteration 2 - bitwise equal to the
  same layout without offload, and resumed bitwise; CP2 x TP2 with sequence parallelism and full recompute,
  bitwise equal to no offload.
- Bad input: more layers than a model chunk holds, the flag without a count, and what offload refuses - one line.
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import pytest
import torch
from badinput import assert_refused
from harness import BASE_FLAGS, run_layout, with_flag
from torch.utils._python_dispatch import TorchDispatchMode

from tricorn import pinned
from tricorn.config import ModelConfig
from tricorn.host_reads import HostReadCounter
from tricorn.model.transformer import GPTModel
from tricorn.parallel.offload import StreamOps, _Group, apply_offload
from tricorn.parallel.recompute import RecomputePlan, apply_recompute
from tricorn.planning.activations import TRICORN
from tricorn.planning.layout import Layout
from tricorn.planning.stage_activations import stage_units
from tricorn.training.activation_probe import ActivationProbe
from tricorn.training.peak import PeakTracker

LAYERS, SEQ, BATCH = 4, 32, 2
RECOMPUTES = {
    "none": {},
    "selective-mlp-norm": dict(recompute_granularity="selective", recompute_modules=["mlp", "norm"]),
    "selective-attn-act-norm": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp_act", "norm"]),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}


def _model(n: int, dtype: torch.dtype, recompute: dict, ops=None) -> tuple[GPTModel, ModelConfig]:
    m = ModelConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, seq_length=SEQ, vocab_size=100, swiglu=True,
        cpu_offloading_num_layers=n, **recompute,
    )  # fmt: skip
    model = GPTModel(m)
    model.init_weights(0)
    model.to(dtype)
    apply_recompute([model], m)
    apply_offload([model], SimpleNamespace(model=m), torch.device("cpu"), ops)
    return model, m


def _step(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(loss, gradients, device bytes alive between forward and backward) of one microbatch."""
    tokens = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(1), device="cpu")
    existing = [*model.parameters(), *model.buffers()]
    with PeakTracker(lambda: {}, existing) as tracker:
        loss = model(tokens, tokens).float().mean()
        held = tracker.total
        loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}, held


def _layout(n: int, dtype: torch.dtype, recompute: dict) -> Layout:
    return Layout(
        micro_batch=BATCH,
        precision="fp32" if dtype == torch.float32 else "bf16",
        device="cpu",
        offload_layers=n,
        recompute=recompute.get("recompute_granularity"),
        recompute_method=recompute.get("recompute_method"),
        recompute_num_layers=recompute.get("recompute_num_layers"),
        recompute_modules=tuple(recompute.get("recompute_modules", ("core_attn",))),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recompute", list(RECOMPUTES))
def test_offload_is_bitwise_and_frees_what_the_estimate_sends_to_host(recompute, dtype):
    kw = RECOMPUTES[recompute]
    loss, grads, held = _step(_model(0, dtype, kw)[0])
    for n in (1, LAYERS - 1):  # under full recompute (uniform, groups of 2): one group, then two
        model, m = _model(n, dtype, kw)
        got_loss, got_grads, got_held = _step(model)
        assert torch.equal(got_loss, loss)  # the same ops on the same bits: copies to host and back change nothing
        for name, g in grads.items():
            assert torch.equal(got_grads[name], g), f"{name}: offload changed the gradient"
        # What left the device between forward and backward is exactly the estimator's host part (the decoder's
        # input is the embedding's output here, so nothing is retained on the device for a received input) - and
        # when every full-recompute checkpoint is offloaded, the int64 position ids they keep (8s bytes per chunk,
        # which the estimate leaves out: activations.py) go with the last of them.
        host = stage_units(m, _layout(n, dtype, kw), 0, LAYERS, TRICORN).host
        checkpoints = [g[0] for g in RecomputePlan.from_model_config(m).full_groups([str(i) for i in range(LAYERS)])]
        every_checkpoint = bool(checkpoints) and max(int(i) for i in checkpoints) < n
        assert held - got_held == host + (8 * SEQ if every_checkpoint else 0) and host > 0


def test_the_probe_still_counts_what_offloaded_layers_save():
    per_layer = []
    for n in (0, 2):
        model, _ = _model(n, torch.float32, {})
        with ActivationProbe([model]) as probe:
            _step(model)
        per_layer.append(probe.layer_bytes())
    assert per_layer[0] == per_layer[1] and all(v[0] > 0 for v in per_layer[0].values())


# ---------------------------------------------------------------- the CUDA contract, on the CPU


class _Recorder:
    """Stand-ins for torch.cuda's streams and events (API checked below) that journal what offload asks for."""

    def __init__(self) -> None:
        self.journal: list[tuple] = []
        self.compute = self.Stream(self)
        self.current = [self.compute]

    class Stream:
        def __init__(self, recorder: _Recorder) -> None:
            self.recorder = recorder

        def wait_stream(self, stream) -> None:
            self.recorder.journal.append(("wait_stream", self, stream))

        def wait_event(self, event) -> None:
            self.recorder.journal.append(("wait_event", self, event))

        def synchronize(self) -> None:
            raise AssertionError("offload made the host wait for a stream")

    class Event:
        def __init__(self, recorder: _Recorder) -> None:
            self.recorder, self.stream = recorder, None

        def record(self, stream=None) -> None:
            self.stream = stream
            self.recorder.journal.append(("record", self, stream))

        def synchronize(self) -> None:
            raise AssertionError("offload made the host wait for an event")

        def query(self) -> bool:
            raise AssertionError("offload polled an event from the host")

    @contextlib.contextmanager
    def use(self, stream):
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()

    def ops(self) -> StreamOps:
        return StreamOps(
            new_stream=lambda: self.Stream(self),
            current_stream=lambda: self.current[-1],
            use_stream=self.use,
            new_event=lambda: self.Event(self),
            record_stream=lambda t, stream: self.journal.append(("record_stream", t.untyped_storage()._cdata, stream)),
        )


def test_the_stand_ins_have_torch_cudas_signatures():
    def names(f):
        return [p for p in inspect.signature(f).parameters if p not in ("self", "cls", "recorder")]

    assert names(_Recorder.Stream.wait_stream) == names(torch.cuda.Stream.wait_stream) == ["stream"]
    assert names(_Recorder.Stream.wait_event) == names(torch.cuda.Stream.wait_event) == ["event"]
    assert names(_Recorder.Event.record) == names(torch.cuda.Event.record) == ["stream"]
    assert names(_Recorder.use) == names(torch.cuda.stream) == ["stream"]
    assert StreamOps.cuda() == StreamOps(
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event, torch.Tensor.record_stream
    )


class _Copies(TorchDispatchMode):
    """Every copy_ between host and device memory, with the stand-in stream it was issued on."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder, self.seen = recorder, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = pinned.host_kind(args[0]), pinned.host_kind(args[1])
            if (dst is None) != (src is None):
                blocking = not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
                self.seen.append(("to host" if dst else "to device", dst or src, blocking, self.recorder.current[-1]))
        return func(*args, **kwargs)


def test_cuda_path_copies_on_the_side_stream_without_host_waits():
    recorder = _Recorder()
    with pinned.stand_in():
        model, _ = _model(LAYERS - 1, torch.bfloat16, RECOMPUTES["selective-mlp-norm"], recorder.ops())
        reference = _model(0, torch.bfloat16, RECOMPUTES["selective-mlp-norm"])[0]
        want_loss, want_grads, _ = _step(reference)
        with HostReadCounter() as counter, _Copies(recorder) as copies:
            loss, grads, _ = _step(model)
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[k], g) for k, g in want_grads.items())
    assert counter.violations() == [], counter.violations()
    side = {s for kind, *_, s in copies.seen}
    assert len(side) == 1 and recorder.compute not in side, "every copy runs on the one side stream"
    assert {(kind, host, blocking) for kind, host, blocking, _ in copies.seen} == {
        ("to host", pinned.PINNED, False),
        ("to device", pinned.PINNED, False),
    }
    (side,) = side
    j = recorder.journal
    # The side stream waits for the compute stream before each layer's copies to host (LAYERS - 1 layers).
    assert [e for e in j if e[0] == "wait_stream"] == [("wait_stream", side, recorder.compute)] * (LAYERS - 1)
    # Each layer's copies are followed by an event on the side stream: one out, one back per layer.
    events = [e[1] for e in j if e[0] == "record"]
    assert len(events) == 2 * (LAYERS - 1) and all(e.stream is side for e in events)
    # The compute stream waits for the events of the copies back before it reads what they brought.
    waited = {id(e[2]) for e in j if e[0] == "wait_event" and e[1] is recorder.compute}
    assert sum(id(e) in waited for e in events) == LAYERS - 1
    # The device storages offloaded are marked used by the side stream; those brought back, by the compute stream.
    marked = [e[2] for e in j if e[0] == "record_stream"]
    assert marked.count(side) == marked.count(recorder.compute) > 0


def test_a_tensor_already_off_the_compute_device_stays_where_it_is():
    """A host tensor that an offloaded layer of a GPU run saves stays as it is: offloaded, it would come back on the
    GPU. Here the layer's device is meta (no GPU on CI) and the saved tensor a CPU one."""
    group = _Group(SimpleNamespace(streams=None, skip=set()), torch.device("meta"))
    host = torch.arange(4)
    handle = group.pack(host)
    assert group.stored == {} and _Group.unpack(handle) is host


# ---------------------------------------------------------------- the trainer

ITERS = 3
FLAGS = with_flag(with_flag(BASE_FLAGS, "--global-batch-size", "8"), "--train-iters", str(ITERS)) + ["--num-layers", "4"]


def _losses(run) -> dict[int, tuple[float, float]]:
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in run.records if "loss" in r}


def test_zb_h1_offload_is_bitwise_and_resumes(tmp_path):
    """The W of zero-bubble computes from what the B brought back; a checkpoint at iteration 2 resumes bit for bit."""
    layout = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--recompute-granularity", "selective"]
    plain = run_layout(FLAGS + layout, 2, tmp_path / "plain")
    offload = ["--cpu-offloading-num-layers", "1"]
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    offloaded = run_layout(FLAGS + layout + offload + save, 2, tmp_path / "offload")
    assert _losses(offloaded) == _losses(plain) and len(_losses(plain)) == ITERS  # bit for bit
    resume = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"]
    resumed = run_layout(FLAGS + layout + offload + resume, 2, tmp_path / "resumed")
    assert _losses(resumed) == {i: v for i, v in _losses(plain).items() if i > 2}


def test_cp2_tp2_sp_full_recompute_offload_is_bitwise(tmp_path):
    """CP's ring and TP/SP's gathers and reductions run on the local tensors the layers bring back."""
    layout = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    plain = run_layout(FLAGS + layout, 4, tmp_path / "plain")
    offloaded = run_layout(FLAGS + layout + ["--cpu-offloading-num-layers", "3"], 4, tmp_path / "offload")
    assert _losses(offloaded) == _losses(plain) and len(_losses(plain)) == ITERS


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--cpu-offloading-num-layers", "5"], "--cpu-offloading-num-layers 5 is more than the 4 layers a model chunk"),
        (["--cpu-offloading"], "--cpu-offloading needs --cpu-offloading-num-layers N"),
        (["--cpu-offloading-num-layers", "1", "--torch-compile"], "--cpu-offloading does not run with --torch-compile"),
    ],
    ids=["more-than-the-stage", "no-count", "compile"],
)
def test_bad_offload_flags_are_one_line(tmp_path, extra, needle):
    assert_refused(FLAGS + extra, tmp_path, needle=needle)
