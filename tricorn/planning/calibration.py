"""Calibration of the step-time model on published Megatron-LM runs, and the prediction intervals it gives.

tricorn/planning/data/published_runs.json holds 41 runs by Megatron's authors (A100 and H100; the README beside
it says where each comes from). ``load_runs`` turns each record into a model, a layout, a cluster, what the run
overlapped, and its measured seconds per iteration, derived with the source's own FLOPs convention:
- Narayanan et al. 2021 (Tables 1, 2): TFLOP/s count 96Bslh^2(1 + s/6h + V/16lh), recompute forward included
  (hardware-FLOPs-like), so seconds = that count / (TFLOP/s x GPUs);
- Korthikanti et al. 2022: the iteration time is published;
- Megatron-Core's README (2024): TFLOP/s count Megatron's ``num_floating_point_operations`` (model FLOPs).
Comparing seconds compares MFU and HFU alike: predicted / measured MFU = measured s / predicted s.
Where a record leaves the layout out, one assumption per source fills it in (``Run.assumptions``).

``fit`` chooses, per GPU type, the four ``Efficiency`` factors (GEMM, attention, NVLink, network) minimising the
squared log error over that type's runs, plus a weak pull (``PRIOR_WEIGHT``) towards the uncalibrated defaults
so that a factor no run exercises stays where it was. No per-record factor. The result is stored as data
(data/step_time_calibration.json, written by ``bench/plan_calibration.py --refit``) together with the in-sample
and leave-one-out errors; ``interval`` gives the p10/p90 multipliers of a predicted time from the leave-one-out
errors, which is what the planner prints.
No collectives, no device work.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from tricorn.config import ModelConfig
from tricorn.planning.efficiency import FIT_FILE, FIT_GPU, Efficiency, efficiency_for, interval, stored, with_interval  # noqa: F401 - the fit's readers, re-exported
from tricorn.planning.flops import megatron_flops, narayanan_flops
from tricorn.planning.hardware import get_gpu
from tricorn.planning.layout import Layout
from tricorn.planning.step_time import Cluster, RunFeatures, step_time

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
RUNS_FILE = os.path.join(DATA_DIR, "published_runs.json")
PRIOR_WEIGHT = 0.02  # per factor, on the squared log deviation from the default: weak next to ~10 runs' errors


@dataclass
class Run:
    """One published run, as the step-time model sees it."""

    index: int
    name: str
    source: str  # narayanan2021 | narayanan2021-zero3 | korthikanti2022 | megatron-core2024
    gpu: str
    model: ModelConfig
    layout: Layout
    features: RunFeatures
    global_batch: int
    gpus: int
    peak_tflops: float
    measured_s: float
    measured_mfu: float  # model FLOPs (no recompute) per second per GPU over peak, from measured_s
    assumptions: tuple[str, ...]

    def cluster(self, eff: Efficiency) -> Cluster:
        return Cluster(self.gpus, 8, get_gpu(self.gpu), self.peak_tflops, efficiency=eff)


def _source(rec: dict) -> str:
    src = rec["source"]
    if "Korthikanti" in src:
        return "korthikanti2022"
    if "Megatron-LM README" in src:
        return "megatron-core2024"
    return "narayanan2021-zero3" if "ZeRO-3" in rec["model"] else "narayanan2021"


def _model(rec: dict) -> ModelConfig:
    heads, kv = rec["heads"] or rec["hidden"] // 128, rec["kv_heads"]
    return ModelConfig(
        num_layers=rec["layers"],
        hidden_size=rec["hidden"],
        num_attention_heads=heads,
        group_query_attention=bool(kv and kv != heads),
        num_query_groups=kv if kv and kv != heads else None,
        ffn_hidden_size=rec["ffn_hidden"] or 4 * rec["hidden"],
        seq_length=rec["seq_len"],
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        vocab_size=rec["vocab"],
    )


def run_from_record(index: int, rec: dict) -> Run:
    """The record as a Run; the assumptions it needed are listed on it."""
    source, assumed = _source(rec), []
    gpu = "a100-80gb" if rec["gpu_type"].startswith("A100") else "h100-80gb"
    peak = get_gpu(gpu).bf16_tflops
    model = _model(rec)
    tp, pp = rec["tp"], rec["pp"]
    if tp is None:  # Table 2's PTD-P rows give TP x PP only; the Megatron-Core 175B strong-scaling row gives nothing
        tp, pp = (8, 12) if source == "narayanan2021" else (8, 6)
        assumed.append(f"TP {tp} x PP {pp}")
    dp = rec["dp"] or rec["gpus"] // (tp * pp * rec["cp"])
    mbs = rec["mbs"]
    if mbs is None:
        mbs = 1
        assumed.append("micro batch 1")
    recompute, modules = None, ("core_attn",)
    text = rec["recompute"] or ""
    if text.startswith("full"):
        recompute = "full"
    elif text.startswith("selective"):
        recompute = "selective"
    elif source == "megatron-core2024":
        assumed.append("no recompute")
    megatron_core = source == "megatron-core2024"
    sp = tp > 1 and ("sequence parallelism" in text and "no sequence" not in text or megatron_core)
    if megatron_core and tp > 1:
        assumed.append("sequence parallel")
    zero = 3 if source == "narayanan2021-zero3" else (1 if megatron_core else 0)
    if megatron_core:
        assumed.append("distributed optimizer (implied by --overlap-param-gather)")
    layout = Layout(
        tp=tp,
        pp=pp,
        cp=rec["cp"],
        dp=dp,
        vpp=rec["vp"] or 1,
        micro_batch=mbs,
        num_microbatches=rec["gbs"] // (mbs * dp),
        sequence_parallel=sp,
        recompute=recompute,
        recompute_modules=modules,
        zero_stage=zero,
        precision="fp16" if rec["dtype"].startswith(("fp16", "16-bit")) else "bf16",
        grads_16bit=not megatron_core,  # 2021-22 Megatron and DeepSpeed reduced fp16 gradients
    )
    # Megatron-Core's benchmark overlapped everything; the 2021-22 runs overlapped no DP traffic (Korthikanti 6.3).
    features = RunFeatures(overlap_grad_reduce=megatron_core, overlap_param_gather=megatron_core, tp_comm_overlap=megatron_core)
    m = rec["measured"]
    gbs, s = rec["gbs"], rec["seq_len"]
    if m.get("iteration_s"):
        seconds = m["iteration_s"]
    elif source.startswith("narayanan"):
        seconds = narayanan_flops(gbs, s, rec["layers"], rec["hidden"], rec["vocab"]) / (m["tflops_per_gpu"] * 1e12 * rec["gpus"])
    else:
        tflops = m["tflops_per_gpu"] or m["mfu"] * peak
        seconds = megatron_flops(model, gbs, model.padded_vocab_size(tp)) / (tflops * 1e12 * rec["gpus"])
    mfu = megatron_flops(model, gbs, model.padded_vocab_size(tp)) / (seconds * rec["gpus"] * peak * 1e12)
    return Run(index, rec["model"], source, gpu, model, layout, features, gbs, rec["gpus"], peak, seconds, mfu, tuple(assumed))


def load_runs(path: str = RUNS_FILE) -> list[Run]:
    with open(path) as fh:
        return [run_from_record(i, rec) for i, rec in enumerate(json.load(fh))]


def predict_s(run: Run, eff: Efficiency) -> float:
    return step_time(run.model, run.layout, run.cluster(eff), run.global_batch, run.features)[0]


def ratio(run: Run, eff: Efficiency) -> float:
    """Predicted / measured MFU (= measured / predicted seconds)."""
    return run.measured_s / predict_s(run, eff)


# ---------------------------------------------------------------- the fit

_FACTORS = ("gemm", "attention", "nvlink", "network")


def _eff(x: list[float]) -> Efficiency:
    return Efficiency(**{k: min(1.0, math.exp(v)) for k, v in zip(_FACTORS, x)})


def _loss(runs: list[Run], x: list[float]) -> float:
    prior = Efficiency()
    err = sum(math.log(ratio(r, _eff(x))) ** 2 for r in runs)
    return err + PRIOR_WEIGHT * sum((v - math.log(getattr(prior, k))) ** 2 for k, v in zip(_FACTORS, x))


def _nelder_mead(f, x0: list[float], step: float = 0.2, iters: int = 400, tol: float = 1e-10) -> list[float]:
    """Minimise ``f`` from ``x0`` (plain Nelder-Mead; a handful of parameters)."""
    pts = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centre = [sum(p[j] for p in pts[:-1]) / (len(pts) - 1) for j in range(len(x0))]
        worst = pts[-1]

        def towards(t: float, centre: list[float] = centre, worst: list[float] = worst) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        refl = towards(-1.0)
        fr = f(refl)
        if fr < vals[0]:
            exp_ = towards(-2.0)
            fe = f(exp_)
            pts[-1], vals[-1] = (exp_, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = towards(0.5)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:  # shrink towards the best point
                pts = [pts[0]] + [[b + 0.5 * (v - b) for b, v in zip(pts[0], p)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(len(pts)), key=vals.__getitem__)]


def fit(runs: list[Run]) -> Efficiency:
    """The four factors that best explain ``runs`` (all of one GPU type)."""
    prior = Efficiency()
    x0 = [math.log(getattr(prior, k)) for k in _FACTORS]
    best = _nelder_mead(lambda x: _loss(runs, x), x0)
    best = _nelder_mead(lambda x: _loss(runs, x), best, step=0.05)  # restart: Nelder-Mead can stall
    return _eff(best)


def fit_all(runs: list[Run]) -> dict[str, Efficiency]:
    return {gpu: fit([r for r in runs if r.gpu == gpu]) for gpu in sorted({r.gpu for r in runs})}


def quantiles(values: list[float], qs: tuple[float, ...] = (0.1, 0.5, 0.9)) -> tuple[float, ...]:
    """Linear-interpolated quantiles (numpy's default method)."""
    v = sorted(values)
    out = []
    for q in qs:
        pos = q * (len(v) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(v) - 1)
        out.append(v[lo] + (v[hi] - v[lo]) * (pos - lo))
    return tuple(out)


def leave_one_out(runs: list[Run], key=lambda r: r.index) -> dict[int, Optional[float]]:
    """Ratio of each run predicted by factors fitted without its group (``key``: the run, or its source).

    None where no run of the same GPU type is left to fit on.
    """
    out: dict[int, Optional[float]] = {}
    for group in sorted({key(r) for r in runs}, key=str):
        held = [r for r in runs if key(r) == group]
        for gpu in sorted({r.gpu for r in held}):
            rest = [r for r in runs if r.gpu == gpu and key(r) != group]
            eff = fit(rest) if rest else None
            for r in held:
                if r.gpu == gpu:
                    out[r.index] = ratio(r, eff) if eff else None
    return out


def calibrate(runs: Optional[list[Run]] = None, sources: bool = True) -> dict:
    """The whole calibration as the JSON that data/step_time_calibration.json stores."""
    runs = runs if runs is not None else load_runs()
    effs = fit_all(runs)
    in_sample = {r.index: ratio(r, effs[r.gpu]) for r in runs}
    loo = leave_one_out(runs)
    loso = leave_one_out(runs, key=lambda r: r.source) if sources else {}

    def rounded(d: dict) -> dict:
        return {str(k): None if v is None else round(v, 4) for k, v in d.items()}

    def summary(d: dict) -> Optional[list[float]]:
        vals = [v for v in rounded(d).values() if v is not None]
        return [round(q, 4) for q in quantiles(vals)] if vals else None

    return dict(
        factors={gpu: e.as_dict() for gpu, e in effs.items()},
        in_sample_p10_p50_p90=summary(in_sample),
        leave_one_out_p10_p50_p90=summary(loo),
        leave_one_source_out_p10_p50_p90=summary(loso),
        leave_one_source_out_runs=sum(v is not None for v in loso.values()),
        runs=len(runs),
        in_sample=rounded(in_sample),
        leave_one_out=rounded(loo),
        leave_one_source_out=rounded(loso),
    )
