"""MoE end to end: expert parallelism equals one process, dropping follows the capacity rule, checkpoints reshard.

Two single-process references (pretrain_gpt.py: dropless, and with token dropping) and ONE launch of 4 ranks
(tests/workers/moe_layouts.py) that trains every layout in turn on meshes of its own - EP 2 and 4 alone, EP2
with TP2, with TP2 and sequence parallelism (DDP and the distributed optimizer), with expert tensor parallelism (ETP2
with TP2, also under SP and with the distributed optimizer), with PP2, with the distributed
optimizer (EP 2 and 4) and with full recompute, EP4 with CP2, EP2 with dropping (also under SP) - and resumes
EP2 checkpoints at EP 4 and 1 (DDP and the distributed optimizer; an ETP2 one at ETP1) and at EP2. Every router statistic (aux
loss, capacity, expert-bias update) is per microbatch over the same tokens in every layout (under SP the
counts are summed over TP; only the capacity is per TP rank), so the layouts compare at the same
--micro-batch-size (1). Keeping the launches few keeps the
file fast on a small CI machine.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from harness import BASE_FLAGS, assert_close, run_layout, run_script, with_flag

WORKER = Path(__file__).parent / "workers" / "moe_layouts.py"

# Every MoE feature at once but dropping: aux loss, sigmoid routing with the expert bias, a shared expert;
# --moe-layer-freq 2 makes layers 0 and 2 MoE, 1 and 3 dense.
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 96 --disable-bias-linear --swiglu --moe-layer-freq 2 "
    "--moe-aux-loss-coeff 0.01 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate 0.01 --moe-shared-expert-intermediate-size 64"
).split()
FLAGS = with_flag(with_flag(with_flag(BASE_FLAGS, "--num-layers", "4"), "--micro-batch-size", "1"), "--train-iters", "4")
DROPLESS = FLAGS + MOE
# Capacity factor 1 drops copies at this size (checked below: the case really drops).
CAPACITY = 1.0
DROPPING = DROPLESS + ["--moe-expert-capacity-factor", str(CAPACITY), "--moe-token-drop-policy", "probs"]
# CP refuses the router statistics (they would cover one sequence chunk): the dropless softmax router alone.
PLAIN = FLAGS + "--num-experts 4 --disable-bias-linear --swiglu".split()
TOKENS = 64  # per microbatch: micro batch 1 x --seq-length 64


def ep(n: int) -> list[str]:
    return ["--expert-model-parallel-size", str(n)]


TP2, PP2, DISTOPT = (
    ["--tensor-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2"],
    ["--use-distributed-optimizer"],
)
SP = TP2 + ["--sequence-parallel"]  # each TP rank routes its half of the sequence
ETP2 = ["--expert-tensor-parallel-size", "2"]  # each expert's w1 column- and w2 row-split over TP
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
EQUIVALENT = {  # layouts of DROPLESS compared with the single-process run
    "ep4": ep(4),
    "ep2": ep(2),
    "ep2-tp2": ep(2) + TP2,
    "ep2-pp2": ep(2) + PP2,
    "ep2-distopt": ep(2) + DISTOPT,
    "ep4-distopt": ep(4) + DISTOPT,
    "ep2-recompute": ep(2) + RECOMPUTE,
    # TP2 x DP2, EP2 over DP: aux loss, expert bias and shared expert over the sequence halves (README "MoE").
    "ep2-tp2-sp": ep(2) + SP,
    "ep2-tp2-sp-distopt": ep(2) + SP + DISTOPT,
    # Expert tensor parallelism: TP2 x DP2, EP2 over DP, each expert split over TP (README "MoE").
    "ep2-etp2": ep(2) + TP2 + ETP2,
    "ep2-etp2-sp": ep(2) + SP + ETP2,
    "ep2-etp2-sp-distopt": ep(2) + SP + ETP2 + DISTOPT,
}
RESUMES = {  # name: (saving run, extra flags of the resumed run)
    "ep2-to-ep2": ("ep2", ep(2)),
    "ep2-to-ep4": ("ep2", ep(4)),
    "ep2-to-ep1": ("ep2", []),
    "ep2-distopt-to-ep4": ("ep2-distopt", ep(4) + DISTOPT),
    "ep2-distopt-to-ep1": ("ep2-distopt", DISTOPT),
    "ep2-etp2-sp-distopt-to-ep1": ("ep2-etp2-sp-distopt", DISTOPT),  # TP-sliced experts back to whole ones
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("moe")
    refs = {
        "dropless": run_layout(DROPLESS + ["--tensorboard-dir", str(tmp / "tb"), "--save", str(tmp / "ref-ckpt")], 1, tmp / "a"),
        "dropping": run_layout(DROPPING, 1, tmp / "b"),
    }
    runs = [{"name": name, "flags": DROPLESS + extra} for name, extra in EQUIVALENT.items()]
    # 16 KiB: the experts' gradients (and owned views) are all-reduced over TP in place, the norms' coalesced.
    next(r for r in runs if r["name"] == "ep2-tp2-sp-distopt")["coalesce_bytes"] = 16 * 2**10
    for name in ("ep2", "ep2-distopt", "ep2-etp2-sp-distopt"):  # these also save after iteration 2
        next(r for r in runs if r["name"] == name).update(save=str(tmp / name), save_at=2)
    # Host reads are counted in iterations without a log line (a log line reads the interval's values).
    runs.append(
        {"name": "reads-ep2-pp2", "flags": with_flag(DROPLESS, "--log-interval", "4") + ep(2) + PP2, "count_host_reads": True}
    )
    runs.append({"name": "dropping-ep2", "flags": DROPPING + ep(2), "record_router_calls": True})
    runs.append({"name": "dropping-ep2-tp2-sp", "flags": DROPPING + ep(2) + SP, "record_router_calls": True})
    runs += [
        {"name": "plain-dp4", "flags": PLAIN},
        {"name": "plain-cp2-ep4", "flags": PLAIN + ["--context-parallel-size", "2"] + ep(4)},
    ]
    runs += [
        {"name": n, "flags": DROPLESS + extra, "load": str(tmp / src), "ckpt_step": 2} for n, (src, extra) in RESUMES.items()
    ]
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"runs": runs, "out": str(tmp / "out.json")}))
    run_script(WORKER, 4, [str(spec)], timeout=600)
    out = json.loads((tmp / "out.json").read_text())
    return {"refs": refs, "runs": out, "tmp": tmp}


def _moe_records(run) -> list[dict]:
    return [r["moe"] for r in run.records if "moe" in r]


def _assert_same_moe_values(got: list[dict], want: list[dict], what: str) -> None:
    """Per iteration: the same copy counts per expert and dropped copies (integers), the same aux loss."""
    assert len(got) == len(want) and want, what
    for it, (g, w) in enumerate(zip(got, want), start=1):
        assert g.keys() == w.keys(), what
        for tag in w:
            # Counts are whole numbers in fp32 (exact); the aux loss is an fp32 sum in another order (FP32_RTOL).
            tol = 0.0 if tag != "moe/aux-loss" else 1e-5 * abs(w[tag])
            assert abs(g[tag] - w[tag]) <= tol, f"{what} iteration {it} {tag}: {g[tag]} vs single-process {w[tag]}"


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_expert_parallel_layouts_equal_single_process(results, name):
    ref, run = results["refs"]["dropless"], results["runs"][name]
    assert_close(run["losses"], ref.losses, what=f"{name} lm loss")
    assert_close(run["grad_norms"], ref.grad_norms, what=f"{name} grad norm")
    _assert_same_moe_values(run["moe"], _moe_records(ref), name)


def test_expert_tensor_parallel_splits_each_expert_over_tp(results):
    """ETP2 holds half of each of its experts: half the routed-expert parameters of the same layout at ETP1."""
    runs = results["runs"]
    assert runs["ep2-etp2"]["expert_params"] * 2 == runs["ep2-tp2"]["expert_params"] > 0
    assert runs["ep2-etp2-sp"]["expert_params"] == runs["ep2-etp2"]["expert_params"]


def test_expert_parallel_with_context_parallel(results):
    # DP4 is the single-process run (every other layout test shows it); CP2 x EP4 splits sequences and experts.
    dp4, cp = results["runs"]["plain-dp4"], results["runs"]["plain-cp2-ep4"]
    assert_close(cp["losses"], dp4["losses"], what="cp2-ep4 lm loss")
    assert_close(cp["grad_norms"], dp4["grad_norms"], what="cp2-ep4 grad norm")


def test_dropped_copies_follow_the_capacity_rule(results):
    ref, run = results["refs"]["dropping"], results["runs"]["dropping-ep2"]
    assert_close(run["losses"], ref.losses, what="dropping ep2 lm loss")
    _assert_same_moe_values(run["moe"], _moe_records(ref), "dropping ep2")
    capacity = math.ceil(TOKENS * 2 / 4 * CAPACITY)  # README: ceil(T x k / E x f) copies per expert and microbatch
    calls = run["router_calls"]
    assert len(calls) == 4 * 2  # 4 iterations x 2 MoE layers x 1 microbatch on this rank
    for routed, dropped, tokens in calls:
        assert tokens == TOKENS and dropped == sum(max(0, n - capacity) for n in routed)
    assert sum(dropped for _, dropped, _ in calls) > 0  # the case really drops


def test_dropping_under_sequence_parallel_uses_each_ranks_capacity(results):
    """Under SP each TP rank drops by the capacity of its own tokens (Megatron's per-rank rule, README "MoE"):
    ceil(T/TP x k / E x f); the logged counts still cover the whole sequence."""
    run = results["runs"]["dropping-ep2-tp2-sp"]
    capacity = math.ceil(TOKENS // 2 * 2 / 4 * CAPACITY)
    calls = run["router_calls"]
    assert len(calls) == 4 * 2 * 2  # 4 iterations x 2 MoE layers x 2 microbatches on this rank (DP2)
    for routed, dropped, tokens in calls:
        assert tokens == TOKENS // 2 and dropped == sum(max(0, n - capacity) for n in routed)
    assert sum(dropped for _, dropped, _ in calls) > 0  # the case really drops
    for values in run["moe"]:  # per iteration: 4 samples x 64 tokens routed to 2 experts, dropped ones included
        assert sum(values[f"moe/layer-0/tokens-expert-{e}"] for e in range(4)) == 4 * TOKENS * 2
        assert values["moe/dropped-tokens"] > 0


@pytest.mark.parametrize("name", list(RESUMES))
def test_ep2_checkpoint_resumes_at_other_expert_parallel_sizes(results, name):
    saved = results["runs"][RESUMES[name][0]]
    resumed = results["runs"][name]
    if name == "ep2-to-ep2":  # the same layout resumes bit for bit (expert biases and moments included)
        assert resumed["losses"] == saved["losses"][2:] and resumed["grad_norms"] == saved["grad_norms"][2:]
        return
    # Streaming: a save writes from the live buffers and a load reads into them, no tensor copied or gathered.
    # What they hold beyond the state is DCP's: the pickled save/load plans gathered and scattered by rank 0
    # (~80 KB per rank here, more with one entry per expert) and on load the stored item it reads. Two
    # buckets (0.76 MB) bound that at this size; holding a whole expert stack's values and moments at once
    # (0.9 MB), as a per-parameter all-reduce does, would exceed it.
    assert saved["save_peak"] <= 2 * saved["largest_bucket_bytes"], saved["save_peak"]
    assert resumed["load_peak"] <= 2 * resumed["largest_bucket_bytes"], resumed["load_peak"]
    # Another EP split reorders fp32 sums from the resume on: the harness's FP32_RTOL reasoning.
    assert_close(resumed["losses"], saved["losses"][2:], what=f"{name} lm loss")
    assert_close(resumed["grad_norms"], saved["grad_norms"][2:], what=f"{name} grad norm")


def test_the_step_reads_only_the_dispatch_counts_on_the_host(results):
    """Dropless loops of GEMMs and the all_to_all splits need the copy counts: one read per MoE layer and
    microbatch, in moe.read_counts; nothing else in the step reads a device value."""
    run = results["runs"]["reads-ep2-pp2"]
    for rank, per_rank in enumerate(run["host_reads"]):
        expected = per_rank["routers"] * run["microbatches"]
        assert expected == 2  # one MoE layer per pipeline stage, two microbatches per DP rank
        for it, reads in enumerate(per_rank["reads"][:3], start=1):  # iteration 4 logs
            assert len(reads) == expected and all("moe.py" in r for r in reads), f"rank {rank} iteration {it}: {reads}"


def test_moe_statistics_reach_tensorboard(results):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(results["tmp"] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"moe/aux-loss", "moe/dropped-tokens", "moe/layer-0/tokens-expert-3", "moe/layer-2/tokens-expert-0"} <= tags
    assert "moe/layer-1/tokens-expert-0" not in tags  # layer 1 is dense
    counts = [acc.Scalars(f"moe/layer-0/tokens-expert-{e}")[0].value for e in range(4)]
    assert sum(counts) == 4 * TOKENS * 2  # per iteration: 4 samples x 64 tokens, each routed to 2 experts
    assert acc.Scalars("moe/aux-loss")[0].value > 0


def test_hf_export_refuses_moe_that_no_family_holds(results, capsys):
    """Mixtral and Qwen3-MoE export (tests/test_hf_families.py); dense layers between MoE ones fit neither."""
    from tricorn.checkpoint.interop.hf import export_main

    tmp = results["tmp"]
    assert export_main(["--load", str(tmp / "ref-ckpt"), "--output", str(tmp / "hf")]) == 2
    assert not (tmp / "hf").exists()
    assert "--moe-layer-freq 2" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
