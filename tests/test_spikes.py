"""Loss spikes survived (issue 32, part 5), --skip-samples, and the straggler line (part 4) on real 2-rank runs.

One chain of four short 2-rank (DP 2) launches, the user's own workflow:

A  --check-for-spiky-loss, a checkpoint every iteration, iteration 13's loss made to spike and an inf put in a
   gradient of iteration 15 (test hooks): both are skipped on the device (the checkpoints before and after are
   equal bitwise, the iteration between them trains), each is named at its log line with its samples, and
   with --max-skipped-iterations 2 the run saves and stops with one line naming both. Nobody is a straggler.
B  resumes A's iteration-12 checkpoint with a --skip-samples file of the samples A named (and a few more, not
   on batch boundaries) and saves at iteration 13.
R  the reference: the same resume on a training set with those samples removed (tests/workers/skip_reference.py);
   B's losses and grad norms equal R's bitwise. Both its ranks are slowed alike (test hook): nobody is named.
C  resumes B's iteration-13 checkpoint with rank 1 slowed by a sleep (test hook): its losses equal B's bitwise,
   and rank 1 is named a straggler after 3 log intervals.

A rank's own work is a few ms here; on this shared machine an unslowed rank can be 1.4x the other for a few
intervals, so the even run is made even by slowing both ranks alike instead.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from badinput import assert_refused
from harness import BASE_FLAGS, run_layout, spawn_ranks, with_flag

from tricorn.checkpoint.io import iter_name, read_meta, read_tensors
from tricorn.data.base import GlobalBatchLoader, MockSamples
from tricorn.data.prefetch import _RankBatches
from tricorn.data.skip_samples import SkipList, SkipSamplesError, format_samples, parse_skip_samples
from tricorn.training.spikes import MIN_HISTORY, SpikeGuard, SpikeLimit

REFERENCE = Path(__file__).parent / "workers" / "skip_reference.py"
SPIKY = ["--check-for-spiky-loss", "--max-skipped-iterations", "2"]
EXTRA_SKIPS = [53, 62]  # inside global batches: the order around them must close up


def flags(iters: int, *extra: str) -> list[str]:
    return with_flag(BASE_FLAGS, "--train-iters", str(iters)) + SPIKY + list(extra)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("spikes")
    hooks = {"TRICORN_TEST_SPIKE_AT_ITER": "13", "TRICORN_TEST_INJECT_INF_AT_ITER": "15"}
    a = run_layout(
        flags(16, "--save", str(tmp / "a"), "--save-interval", "1", "--tensorboard-dir", str(tmp / "tb")),
        2,
        tmp / "run-a",
        check=False,
        env=hooks,
    )
    stop = [line for line in a.stderr.splitlines() if line.startswith("tricorn: error: ")]
    named = re.findall(r"iteration (\d+) samples ([\d -]+?)(?:;|,)", stop[0]) if len(stop) == 1 else []
    skips = sorted({i for _, s in named for i in parse_skip_samples(s, "the stop line").indices} | set(EXTRA_SKIPS))
    (tmp / "skips.txt").write_text("# from run A's stop line\n" + format_samples(skips) + "\n")
    resume = ["--load", str(tmp / "a"), "--ckpt-step", "12"]
    b = run_layout(
        flags(16, *resume, "--skip-samples", str(tmp / "skips.txt"), "--save", str(tmp / "b"), "--save-interval", "13"),
        2,
        tmp / "run-b",
    )
    ref_metrics = tmp / "run-r" / "metrics.jsonl"
    ref_metrics.parent.mkdir()
    cmd = [sys.executable, str(REFERENCE), json.dumps(skips), *flags(16, *resume), "--metrics-file", str(ref_metrics)]
    even = {"TRICORN_TEST_SLOW_RANK": "0,1", "TRICORN_TEST_SLOW_RANK_SLEEP_S": "0.1"}  # both ranks alike
    r_ranks = spawn_ranks(cmd, 2, timeout=240, env=even)
    assert all(rc == 0 for rc, _, _ in r_ranks), "\n".join(err[-2000:] for _, _, err in r_ranks)
    r = [json.loads(line) for line in ref_metrics.read_text().splitlines()]
    slow = {"TRICORN_TEST_SLOW_RANK": "1", "TRICORN_TEST_SLOW_RANK_SLEEP_S": "0.1"}
    c = run_layout(
        flags(16, "--load", str(tmp / "b"), "--ckpt-step", "13", "--skip-samples", str(tmp / "skips.txt")),
        2,
        tmp / "run-c",
        env=slow,
    )
    r_stderr = "\n".join(err for _, _, err in r_ranks)
    return {"tmp": tmp, "a": a, "stop": stop, "named": named, "skips": skips, "b": b, "r": r, "r_stderr": r_stderr, "c": c}


def test_spiky_iterations_are_skipped_bitwise_and_the_run_goes_on(chain):
    ckpt = chain["tmp"] / "a"
    state = {i: read_tensors(ckpt / iter_name(i)) for i in (12, 13, 14, 15)}
    for before, after in ((12, 13), (14, 15)):  # model, fp32 moments: untouched by a skipped iteration
        assert state[before].keys() == state[after].keys()
        for k, v in state[before].items():
            assert torch.equal(v, state[after][k]), f"{k} changed in skipped iteration {after}"
    assert any(not torch.equal(v, state[14][k]) for k, v in state[13].items()), "iteration 14 must train"
    losses = {r["iteration"]: r for r in chain["a"].records if "loss" in r}
    assert losses[13]["skipped"] and losses[15]["skipped"] and not losses[14]["skipped"]
    assert losses[14]["loss"] < 10, "the loss after a skipped spike is a normal one"
    out = chain["a"].stdout
    assert re.search(r" skipped iteration 13 \(spiky: lm loss \S+E\+03, .*\): samples 48-51$", out, re.M), out[-3000:]
    assert re.search(r" skipped iteration 15 \(spiky: lm loss \S+, grad norm (INF|NAN); .*\): samples 56-59$", out, re.M)
    from test_observability import scalars

    values, _ = scalars(chain["tmp"] / "tb")
    assert values["spiky-iterations"][-1] == (15, 2.0) and values["spiky-iterations"][12] == (13, 1.0)


def test_too_many_spikes_save_and_stop_with_one_line(chain):
    a, stop = chain["a"], chain["stop"]
    assert a.returncode == 1 and len(stop) == 1, a.stderr[-3000:]
    assert "2 spiky iterations within the last 100 (--max-skipped-iterations 2), stopping after iteration 15" in stop[0]
    assert chain["named"] == [("13", "48-51"), ("15", "56-59")], stop[0]
    assert f"checkpoint of iteration 15 saved in {chain['tmp'] / 'a'}" in stop[0]
    meta = read_meta(chain["tmp"] / "a" / iter_name(15))
    assert meta["iteration"] == 15 and [r[0] for r in meta["spiky_loss"]["recent"]] == [13, 15]
    assert meta["spiky_loss"]["count"] == 15 - 2  # the running means took the accepted iterations only


def test_skip_samples_equals_a_run_on_data_without_them(chain):
    b, r = chain["b"], [x for x in chain["r"] if "loss" in x]
    assert [x["iteration"] for x in b.records] == [13, 14, 15, 16]
    # Bitwise: the same layout on the same tokens (the view only renumbers the samples).
    assert b.losses == [x["loss"] for x in r] and b.grad_norms == [x["grad_norm"] for x in r]
    assert not any(x["skipped"] for x in b.records), "without the spiked samples nothing spikes"
    meta = read_meta(chain["tmp"] / "b" / iter_name(13))
    # Iteration 13 took 52 54 55 60: 48-51, 53 and 56-59 passed over.
    assert (meta["consumed_train_samples"], meta["skipped_train_samples"]) == (52, 9)


def test_skip_samples_resume_is_bitwise(chain):
    b, c = chain["b"], chain["c"]
    assert c.losses == b.losses[1:] and c.grad_norms == b.grad_norms[1:]


def test_a_slowed_rank_is_named_and_an_even_run_names_nobody(chain):
    c = chain["c"]
    lines = [line for line in c.stderr.splitlines() if "straggler:" in line]
    assert len(lines) == 1, c.stderr[-3000:]
    assert re.search(r"straggler: rank 1 \(pp0 dp1 cp0 tp0\) \S+ ms \(x1\.\d\d\) of own work", lines[0]), lines[0]
    assert "for 3 log intervals in a row (up to iteration 16)" in lines[0]
    assert [x["straggler"]["straggler-slowest-rank"] for x in c.records] == [1.0, 1.0, 1.0]
    assert "| slowest rank: 1 (" in c.stdout
    # An even run: both ranks sleep alike, so the load of this shared machine (rank 0's TensorBoard and
    # checkpoint threads competing for a core made it 1.38x slower for 3 intervals in an unslowed run) stays
    # small against the step; the median moves with everybody, nobody is named.
    assert "straggler:" not in chain["r_stderr"], chain["r_stderr"][-3000:]
    assert [x["straggler"]["straggler-median-seconds"] > 0.2 for x in chain["r"] if "straggler" in x] == [True] * 4


# ---------------------------------------------------------------- in-process units


def test_skip_list_takes_the_order_minus_the_listed_samples():
    skip = SkipList((2, 3, 7, 20))
    kept = [i for i in range(40) if i not in skip]
    for start in range(0, 12):
        for count in (1, 4, 9):
            first = next(k for k, i in enumerate(kept) if i >= start)
            assert skip.take(start, count) == kept[first : first + count], (start, count)


def test_skip_file_syntax_round_trips_and_refuses_garbage():
    skip = parse_skip_samples("# spikes\n4800-4803, 5017\n\n5020 # late\n", "f")
    assert skip.indices == (4800, 4801, 4802, 4803, 5017, 5020)
    assert format_samples(skip.indices) == "4800-4803 5017 5020"
    for bad, token in (("12 x3", "x3"), ("9-4", "9-4"), ("-1", "-1"), ("1.5", "1.5")):
        with pytest.raises(SkipSamplesError, match=f"f line 1: '{re.escape(token)}' is not a sample index"):
            parse_skip_samples(bad, "f")
    with pytest.raises(SkipSamplesError, match="f line 2: the list reaches more than 1,000,000 samples at '4-1000000'"):
        parse_skip_samples("0-3\n4-1000000\n", "f")
    assert len(parse_skip_samples("0-3\n4-999999\n", "f")) == 10**6


def test_loader_and_prefetch_sampler_pass_over_the_same_samples():
    skip = SkipList((5, 6, 13))
    source = MockSamples(50, 8, 1)
    ranks = [GlobalBatchLoader(source, r, 2, skip=skip) for r in range(2)]
    batches = [[loader.next(4).sample_ids for loader in ranks] for _ in range(4)]
    order = [i for step in batches for ids in step for i in ids]
    assert order == [i for i in range(19) if i not in skip] and ranks[0].state_dict() == {
        "consumed_samples": 16,
        "skipped_samples": 3,
    }
    resumed = GlobalBatchLoader(source, 1, 2, skip=skip)
    resumed.load_state_dict({"consumed_samples": 8, "skipped_samples": 2})
    sampler = iter(_RankBatches(resumed, lambda consumed: 4))
    assert [next(sampler), next(sampler)] == [list(batches[2][1]), list(batches[3][1])]


def test_guard_skips_spikes_and_non_finite_values_but_not_overflows():
    guard = SpikeGuard(factor=3.0, max_skipped=2, device=torch.device("cpu"))

    def step(it: int, loss: float, norm: float, overflow: bool = False) -> bool:
        spike = guard.veto(torch.tensor(loss), it, range(4 * it - 4, 4 * it))(torch.tensor(norm), torch.tensor(overflow))
        return bool(spike)

    for it in range(1, MIN_HISTORY):
        assert not step(it, 2.0, 1.0)
    assert not step(MIN_HISTORY, 7.0, 1.0), "no spike before MIN_HISTORY accepted iterations"
    assert step(20, 9.0, 1.0) and step(21, 2.0, 3.5) and step(22, float("nan"), 1.0)
    assert not step(23, 2.0, float("inf"), overflow=True), "an fp16 overflow is the loss scaler's skip"
    assert not step(24, 5.0, 2.5), "the skipped iterations did not move the means"
    lines: list[str] = []
    assert guard.report(guard.records().tolist(), 24, lines.append) == {"spiky-iterations": 3.0}
    assert [line.split(" (")[0] for line in lines] == [f" skipped iteration {i}" for i in (20, 21, 22)]
    with pytest.raises(SpikeLimit, match="3 spiky iterations within the last 100 .* iteration 20 samples 76-79; iteration 21"):
        guard.check_limit(24)


BAD = [
    (["--spiky-loss-factor", "1"], "--spiky-loss-factor must be greater than 1, got 1.0"),
    (["--straggler-factor", "0.9"], "--straggler-factor must be greater than 1, got 0.9"),
    (["--max-skipped-iterations", "101"], "--max-skipped-iterations must be in [1, 100], got 101"),
    (["--skip-samples", "SKIPS", "garbage"], "--skip-samples SKIPS line 2: 'oops' is not a sample index or an inclusive range"),
    (
        ["--skip-samples", "SKIPS", "outside"],
        "names 1 sample(s) outside the training data, e.g. 20: this run's sample order has 20 samples",
    ),
    (["--skip-samples", "no-such-file"], "--skip-samples no-such-file: cannot read it (No such file or directory)"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[0][0] + (b[0][-1] if len(b[0]) > 2 else "") for b in BAD])
def test_bad_input_is_one_line_before_launch(tmp_path, extra, needle):
    work = tmp_path / "work"
    work.mkdir()
    skips = tmp_path / "skips.txt"
    skips.write_text({"garbage": "3\noops\n", "outside": "4 19-20\n"}.get(extra[-1], ""))
    argv = [*BASE_FLAGS, *[str(skips) if a == "SKIPS" else a for a in extra[:2]]]
    assert_refused(argv, work, needle=needle.replace("SKIPS", str(skips)))


def test_guard_state_survives_a_checkpoint_bitwise():
    """meta.json holds the running means as JSON floats: the resumed guard has the same bits and decides alike."""
    guard = SpikeGuard(factor=2.0, max_skipped=5, device=torch.device("cpu"))
    for it in range(1, 15):
        guard.veto(torch.tensor(2.0 + 0.1 * (it % 3)), it, range(it, it + 1))(torch.tensor(1.0 / it), None)
    guard.veto(torch.tensor(99.0), 15, range(15, 16))(torch.tensor(1.0), None)  # spiky, not yet read at a log line
    resumed = SpikeGuard(factor=2.0, max_skipped=5, device=torch.device("cpu"))
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    for name in ("loss_ema", "norm_ema", "count"):
        assert torch.equal(getattr(resumed, name), getattr(guard, name)), name
    assert [s.iteration for s in resumed.recent] == [15] and guard.recent == [], "the unread spike is saved, not consumed"
    for g in (guard, resumed):
        g._pending.clear()
    loss, norm = torch.tensor(4.3), torch.tensor(0.2)  # just above 2 x the loss mean (~2.1): a spike only when armed
    assert bool(guard.veto(loss, 16, ())(norm, None)) == bool(resumed.veto(loss, 16, ())(norm, None))
    assert torch.equal(resumed.loss_ema, guard.loss_ema)
