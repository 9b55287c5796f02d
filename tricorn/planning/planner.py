"""The layout search behind `tricorn plan` (tricorn/plan_cli.py): enumerate parallel layouts for a cluster, keep
those that fit, rank them by predicted step time.

Enumerated: TP (a divisor of the GPUs per node that divides the heads, key/value groups and ffn width), CP
(2, 4, ..., 32 for sequences of CP_MIN_SEQ tokens or more, while each rank keeps >= 1024 tokens), PP (any
count up to the layers; one that does not divide them puts the remainder on the first and last stages through
--decoder-first/last-pipeline-num-layers), virtual stages (even splits, when the microbatch count divides by
PP), the pipeline schedule for PP >= 2 (1F1B or interleaved; zb-h1 on one chunk; zbv and dualpipev on 2 chunks
of an even split with untied embeddings; none of the three with FP8 or Transformer Engine), DP (the rest; it must divide the global batch), micro batch (every divisor of the batch per DP rank, the
largest that fits), recompute (none, selective of core_attn / mlp / mlp + norm / all three, full),
distributed optimizer (off, ZeRO-1, and ZeRO-2/3 when PP = 1), and for a mixture of experts the expert-parallel
size (a divisor of DP x CP and of the experts; ZeRO-2/3 only at EP 1). Sequence parallelism is on whenever TP > 1
(not with MoE).
A layout fits when the memory estimator's worst rank stays under (1 - --memory-margin) of the device memory.

Step-time model: step_time.py, with factors calibrated on published runs (calibration.py). Each time figure
carries the p10-p90 interval of the calibration's leave-one-out errors. Layouts whose interval overlaps the
fastest one's are ties: among them the planner prefers no recompute and no ZeRO-2/3 (certain extra work), then
less CP, fewer pipeline stages, less TP, fewer virtual stages, the plainer schedule, then less memory, and says so in the `why` column. MFU counts model FLOPs (no recompute),
HFU hardware FLOPs (recompute included).
No collectives, no device work.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

from tricorn.config import ModelConfig
from tricorn.planning import calibration, memory_features
from tricorn.planning.context_comm import CP_COMM_TYPES
from tricorn.planning.flops import iteration_flops
from tricorn.planning.hardware import GiB
from tricorn.planning.layout import Layout
from tricorn.planning.memory import MemoryEstimate, estimate, total_params
from tricorn.planning.step_time import Cluster, step_time

CP_MIN_SEQ = 16384  # below this, CP's split attention costs more than its memory saving is worth
CP_SIZES = (1, 2, 4, 8, 16, 32)
MAX_VPP = 8
SCHEDULE_PREFERENCE = ("1f1b", "zb-h1", "zbv", "dualpipev")  # among ties, the plainer first
# (granularity, modules), cheapest first. With flash attention the MLP holds most of a layer's activations.
RECOMPUTE: tuple[tuple[Optional[str], tuple[str, ...]], ...] = (
    (None, ("core_attn",)),
    ("selective", ("core_attn",)),
    ("selective", ("mlp",)),
    ("selective", ("mlp", "norm")),
    ("selective", ("core_attn", "mlp", "norm")),
    ("full", ("core_attn",)),
)
_INTERVAL_FIGURES = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "hfu")


@dataclass
class Plan:
    layout: Layout
    memory_bytes: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs per second per GPU
    mfu: float
    breakdown: dict
    hw_tflops_per_gpu: float = 0.0  # hardware FLOPs (recompute included)
    hfu: float = 0.0
    tie: bool = False  # within the interval of the fastest layout
    why: str = ""
    interval: tuple[float, float] = (1.0, 1.0)  # p10, p90 multipliers of the predicted time
    extra: dict = field(default_factory=dict)
    host_bytes: float = 0.0  # host memory per GPU of the offloaded state and activations

    def bounds(self, name: str) -> tuple[float, float]:
        """(p10, p90) of a figure: a time scales with the interval, a rate inversely."""
        lo, hi = self.interval
        x = getattr(self, name)
        return (x * lo, x * hi) if name == "step_time_s" else (x / hi, x / lo)

    def to_dict(self) -> dict:
        lay = self.layout
        out = dict(
            tp=lay.tp,
            pp=lay.pp,
            vpp=lay.vpp,
            pipeline_schedule=lay.schedule,
            cp=lay.cp,
            dp=lay.dp,
            ep=lay.ep,
            micro_batch=lay.micro_batch,
            num_microbatches=lay.num_microbatches,
            sequence_parallel=lay.sequence_parallel,
            recompute=lay.recompute,
            recompute_modules=list(lay.recompute_modules) if lay.recompute == "selective" else None,
            decoder_first_pipeline_num_layers=lay.first_stage_layers,
            decoder_last_pipeline_num_layers=lay.last_stage_layers,
            distributed_optimizer=lay.zero_stage > 0,
            zero_stage=lay.zero_stage,
            memory_features=list(memory_features.features_of(lay)),
            cpu_offloading_num_layers=lay.offload_layers,
            optimizer_cpu_offload=lay.optimizer_offload,
            exp_avg_dtype=lay.exp_avg_dtype,
            exp_avg_sq_dtype=lay.exp_avg_sq_dtype,
            fp8_param_gather=lay.fp8_param_gather,
            memory_bytes=self.memory_bytes,
            memory_gb=round(self.memory_bytes / GiB, 2),
            host_memory_bytes=self.host_bytes,
        )
        for name in _INTERVAL_FIGURES:
            lo, hi = self.bounds(name)
            out.update({name: getattr(self, name), f"{name}_p10": lo, f"{name}_p90": hi})
        out.update(tie=self.tie, why=self.why, breakdown=self.breakdown)
        return out


# ---------------------------------------------------------------- enumeration


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tps(model: ModelConfig, gpus_per_node: int) -> list[int]:
    out = []
    for tp in divisors(gpus_per_node):
        if model.num_attention_heads % tp == 0 and model.kv_heads % tp == 0 and model.ffn_size % tp == 0:
            out.append(tp)
    return out


def stage_split(num_layers: int, pp: int) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(first, last) stage layers for PP stages: (None, None) when PP divides the layers, else the middle stages
    take ceil(layers / PP) each and the first and last share the rest (the last, which runs the head, the
    smaller half); None when no such split exists."""
    if num_layers % pp == 0:
        return None, None
    k = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * k
    last = rest // 2
    first = rest - last
    if pp < 2 or last < 1 or first > k:
        return None
    return first, last


def valid_cps(model: ModelConfig) -> list[int]:
    seq = model.seq_length
    return [cp for cp in CP_SIZES if cp == 1 or (seq >= CP_MIN_SEQ and seq % (2 * cp) == 0 and seq // cp >= 1024)]


def valid_eps(model: ModelConfig, dp_cp: int) -> list[int]:
    """Expert-parallel sizes of a mixture of experts: divisors of DP x CP that divide the experts; 1 when dense."""
    return [ep for ep in divisors(dp_cp) if model.num_experts % ep == 0] if model.num_experts else [1]


def sequence_parallel(model: ModelConfig, tp: int) -> bool:
    """On whenever TP > 1 (Megatron's practice; with MoE the experts then take each TP rank's sequence shard)."""
    return tp > 1


def layout_groups(
    model: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    precision: str = "bf16",
    fp8: tuple[str, Optional[str]] = ("local", None),
    attention: Optional[Layout] = None,
) -> Iterator[list[Layout]]:
    """Layouts in groups that differ only in the micro batch, smallest first (memory grows along a group).
    ``fp8``: (--transformer-impl, the FP8 recipe in effect or None); Transformer Engine's FP8 takes no recompute.
    ``attention``: a layout whose attention_work and per_sample_positions every layout takes (documents, window)."""
    impl, recipe = fp8
    recomputes = RECOMPUTE[:1] if impl == "transformer_engine" and recipe else RECOMPUTE
    for tp, cp, pp, ep, split in _grids(model, cluster, global_batch):
        dp = cluster.gpus // (tp * cp * pp)
        base = Layout(tp=tp, pp=pp, cp=cp, dp=dp, sequence_parallel=sequence_parallel(model, tp), precision=precision, ep=ep)
        base = dataclasses.replace(base, transformer_impl=impl, fp8_recipe=recipe)
        base = dataclasses.replace(base, first_stage_layers=split[0], last_stage_layers=split[1])
        if attention is not None:
            base = dataclasses.replace(
                base, attention_work=attention.attention_work, per_sample_positions=attention.per_sample_positions
            )
        for comm in cp_comm_types(model, tp, cp):
            yield from _groups(
                model, global_batch, dataclasses.replace(base, cp_comm_type=comm), pp, dp, cp, ep, split, recomputes
            )


def cp_comm_types(model: ModelConfig, tp: int, cp: int) -> tuple[str, ...]:
    """The --cp-comm-type values a layout may use: p2p alone without CP; a2a only with query heads per TP rank
    divisible by CP (validation's rule)."""
    if cp == 1:
        return ("p2p",)
    return tuple(c for c in CP_COMM_TYPES if c != "a2a" or (model.num_attention_heads // tp) % cp == 0)


def schedules(model: ModelConfig, base: Layout, pp: int, vpp: int, split) -> tuple[str, ...]:
    """The --pipeline-schedule values of a pipeline of ``pp`` ranks x ``vpp`` chunks: 1F1B (interleaved with
    chunks), and where validate_pipeline admits them the zero-bubble ones - zb-h1 on one chunk, zbv and
    dualpipev on 2 chunks of an even split with untied embeddings - but not with FP8 or Transformer Engine,
    whose GEMMs compute their own weight gradients. (ZeRO-2/3 never meets PP here; m is checked per layout.)"""
    if pp == 1:
        return ("1f1b",)
    zero_bubble = base.fp8_recipe is None and base.transformer_impl == "local"
    if vpp == 1:
        return ("1f1b", "zb-h1") if zero_bubble else ("1f1b",)
    v_shape = zero_bubble and vpp == 2 and split[0] is None and model.untie_embeddings_and_output_weights
    return ("1f1b", "zbv", "dualpipev") if v_shape else ("1f1b",)


def _microbatches_fit(schedule: str, pp: int, vpp: int, m: int) -> bool:
    """The schedule can run ``m`` microbatches (stages.validate_pipeline's rules)."""
    if schedule == "zb-h1":
        return m >= pp
    if schedule == "dualpipev":
        return m >= 2 * pp
    return not (vpp > 1 and schedule != "zbv" and m % pp)


def _groups(
    model: ModelConfig, global_batch: int, base: Layout, pp: int, dp: int, cp: int, ep: int, split, recomputes
) -> Iterator[list[Layout]]:
    """The groups of one process grid and comm type: virtual stages, schedule, recompute, ZeRO, micro batch."""
    zeros = ((0, 1, 2, 3) if pp == 1 and ep == 1 else (0, 1)) if dp * cp > 1 else (0,)
    vpps = [1] if split[0] is not None or pp == 1 else [v for v in divisors(model.num_layers // pp) if v <= MAX_VPP]
    for vpp in vpps:
        for schedule in schedules(model, base, pp, vpp, split):
            for recompute, modules in recomputes:
                for zero in zeros:
                    group = []
                    for mb in divisors(global_batch // dp):
                        m = global_batch // (mb * dp)
                        if not _microbatches_fit(schedule, pp, vpp, m):
                            continue
                        group.append(
                            dataclasses.replace(
                                base,
                                vpp=vpp,
                                schedule=schedule,
                                micro_batch=mb,
                                num_microbatches=m,
                                recompute=recompute,
                                recompute_modules=modules,
                                zero_stage=zero,
                            )
                        )
                    if group:
                        yield group


def _grids(model: ModelConfig, cluster: Cluster, global_batch: int) -> Iterator[tuple]:
    """(tp, cp, pp, ep, (first, last) stage layers) of every process grid the cluster and the batch divide."""
    for tp in valid_tps(model, cluster.gpus_per_node):
        for cp in valid_cps(model):
            for pp in range(1, model.num_layers + 1):
                split = stage_split(model.num_layers, pp)
                if cluster.gpus % (tp * cp * pp) or split is None:
                    continue
                dp = cluster.gpus // (tp * cp * pp)
                if global_batch % dp == 0:
                    for ep in valid_eps(model, dp * cp):
                        yield tp, cp, pp, ep, split


def enumerate_layouts(model: ModelConfig, cluster: Cluster, global_batch: int, precision: str = "bf16") -> Iterator[Layout]:
    for group in layout_groups(model, cluster, global_batch, precision):
        yield from group


def worst_estimate(model: ModelConfig, layout: Layout) -> MemoryEstimate:
    # The first stage (most microbatches in flight, embedding) or the last (logits) is the worst; with the
    # zero-bubble schedules the last (zb-h1: the most weight-gradient stores; zbv / dualpipev: the V's tip) or
    # the first (embedding and head of the V).
    return estimate(model, layout, stages=(0, layout.pp - 1))


def worst_memory(model: ModelConfig, layout: Layout) -> float:
    return worst_estimate(model, layout).total_bytes


# ---------------------------------------------------------------- planning


@dataclass
class PlanResult:
    plans: list[Plan]  # the top k, the chosen layout first
    considered: int  # layouts that satisfied every divisibility rule
    fitting: int
    leanest: Optional[tuple[Layout, float]]  # the layout needing least memory among those that did not fit
    ties: int = 0  # layouts within the interval of the fastest
    fastest: Optional[Plan] = None
    plain: int = 0  # of ``fitting``: those that fit without memory features
    skipped: int = 0  # micro-batch layouts not searched with memory features (too slow to matter: ``_with_features``)
    features_searched: bool = False  # whether the layouts that did not fit were tried with memory features


def evaluate(model: ModelConfig, lay: Layout, cluster: Cluster, global_batch: int, memory: float, host: float = 0.0) -> Plan:
    """The predicted figures of one layout, with the calibration's interval; ``host``: its host memory per GPU."""
    t, breakdown = step_time(model, lay, cluster, global_batch)
    flops = iteration_flops(
        model,
        global_batch,
        vocab_size=model.padded_vocab_size(lay.tp),
        recompute_granularity=lay.recompute,
        recompute_modules=lay.recompute_modules,
    )
    per_gpu = 1e12 * cluster.gpus * t
    tflops, hw = flops.model / per_gpu, flops.hardware / per_gpu
    tokens = global_batch * model.seq_length / t
    p = Plan(lay, memory, t, tokens, tflops, tflops / cluster.peak_tflops, breakdown, hw, hw / cluster.peak_tflops)
    p.interval = calibration.interval()
    p.host_bytes = host
    return p


def _extra_work(lay: Layout) -> tuple[int, int, int]:
    """Memory features (memory_features.py), recompute and ZeRO-2/3 trade certain extra work - or, for bf16 moments,
    numerics - for memory (ZeRO-1 costs nothing over plain DP)."""
    recompute = RECOMPUTE.index((lay.recompute, lay.recompute_modules if lay.recompute == "selective" else ("core_attn",)))
    return len(memory_features.features_of(lay)), recompute, max(0, lay.zero_stage - 1)


def _preference(p: Plan) -> tuple:
    """Among ties: no extra work first, then less CP (no calibration run used CP), fewer pipeline stages, less
    TP, fewer virtual stages, the plainer schedule (1F1B before the zero-bubble ones, whose W's hold memory), then
    less memory (headroom against the estimate's error), then the faster."""
    lay = p.layout
    simpler = SCHEDULE_PREFERENCE.index(lay.schedule)
    return (_extra_work(lay), lay.cp, lay.pp, lay.tp, lay.vpp, simpler, round(p.memory_bytes / GiB, 1), p.step_time_s)


def _why(p: Plan, best: Plan) -> str:
    if p is best:
        return "fastest predicted"
    a, b = p.layout, best.layout
    if _extra_work(a) != _extra_work(b):
        less = "less" if _extra_work(a) < _extra_work(b) else "more"
        mine, theirs = _extra_work(a), _extra_work(b)
        parts = [f"memory features {features_text(a)} vs {features_text(b)}"] if mine[0] != theirs[0] else []
        parts += [f"recompute {recompute_text(a)} vs {recompute_text(b)}"] if mine[1] != theirs[1] else []
        parts += [f"ZeRO-{a.zero_stage} vs ZeRO-{b.zero_stage}"] if mine[2] != theirs[2] else []
        return f"tie with the fastest; {less} extra work ({', '.join(parts)})"
    for name, mine, theirs in (
        ("CP", a.cp, b.cp),
        ("pipeline stages", a.pp, b.pp),
        ("TP", a.tp, b.tp),
        ("virtual stages", a.vpp, b.vpp),
    ):
        if mine != theirs:
            return f"tie with the fastest; {'fewer' if mine < theirs else 'more'} {name} ({mine} vs {theirs})"
    if a.schedule != b.schedule:
        plainer = SCHEDULE_PREFERENCE.index(a.schedule) < SCHEDULE_PREFERENCE.index(b.schedule)
        return f"tie with the fastest; {'plainer' if plainer else 'less plain'} schedule ({a.schedule} vs {b.schedule})"
    verb = "less" if p.memory_bytes <= best.memory_bytes else "more"
    return f"tie with the fastest; {verb} memory ({p.memory_bytes / GiB:.1f} vs {best.memory_bytes / GiB:.1f} GiB)"


def rank(plans: list[Plan]) -> list[Plan]:
    """Ties with the fastest first, simplest first; then the rest by predicted time. Marks ``tie`` and ``why``."""
    if not plans:
        return []
    by_time = sorted(plans, key=lambda p: (p.step_time_s, p.memory_bytes))
    fastest = by_time[0]
    fast_hi = fastest.bounds("step_time_s")[1]
    ties = [p for p in by_time if p.bounds("step_time_s")[0] <= fast_hi]
    rest = [p for p in by_time if p.bounds("step_time_s")[0] > fast_hi]
    ties.sort(key=_preference)
    chosen = ties[0]
    for p in ties:
        p.tie = True
        p.why = _why(p, fastest)
    if chosen is not fastest:
        chosen.why += "; preferred among the ties"
    for p in rest:
        p.why = f"{p.step_time_s / fastest.step_time_s - 1:.0%} slower than the fastest, beyond the interval"
    return ties + rest


FEATURE_MODES = ("auto", "all", "off")


def plan(
    model: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    precision: str = "bf16",
    top_k: int = 5,
    fp8: tuple[str, Optional[str]] = ("local", None),
    attention: Optional[Layout] = None,
    features: str = "auto",
) -> PlanResult:
    """Every layout that fits, ranked. ``features`` (memory_features.py): "auto" tries the memory features on the
    layouts that do not fit as they are when fewer than ``top_k`` do; "all" always; "off" never."""
    fits: list[Plan] = []
    considered = 0
    estimate_of = functools.partial(worst_estimate, model)
    pending: list[list[tuple[Layout, Optional[MemoryEstimate]]]] = []  # per group, the micro batches that did not fit
    for group in layout_groups(model, cluster, global_batch, precision, fp8, attention):
        considered += len(group)
        for i, lay in enumerate(group):  # memory grows with the micro batch: the rest of the group waits for features
            est = estimate_of(lay)
            if est.total_bytes > cluster.usable_bytes:
                pending.append([(lay, est)] + [(g, None) for g in group[i + 1 :]])
                break
            fits.append(evaluate(model, lay, cluster, global_batch, est.total_bytes, est.host_bytes))
    plain = len(fits)
    searched = features == "all" or (features == "auto" and plain < top_k)
    skipped, leanest = _with_features(model, cluster, global_batch, top_k, pending, fits, estimate_of, searched)
    ranked = rank(fits)
    fastest = min(fits, key=lambda p: p.step_time_s) if fits else None
    result = PlanResult(ranked[:top_k], considered, len(fits), leanest, sum(p.tie for p in ranked), fastest, plain, skipped)
    result.features_searched = searched
    return result


def _with_features(model, cluster, global_batch, top_k, pending, fits, estimate_of, searched: bool):
    """The layouts that do not fit as they are, with memory features (memory_features.py) when ``searched``:
    appended to ``fits``. Returns (micro-batch layouts not searched, the leanest need among those that fit with
    nothing). A feature never makes a step faster but for bf16 moments' lighter AdamW and FP8 weights' lighter
    gather, so a layout's time with those two bounds all its variants: one that could not be the fastest, and
    would sort after top-k featureless ties or after top-k faster plans, is not searched."""
    host_usable = cluster.gpu.host_memory_bytes * memory_features.HOST_MEMORY_FRACTION
    lo, hi = calibration.interval()
    skipped, leanest = 0, None
    for tail in pending:
        for lay, est in tail:
            est = est or estimate_of(lay)
            if not searched:
                leanest = _leaner(leanest, lay, est.total_bytes)
                break
            if len(fits) >= top_k:
                times = sorted(p.step_time_s for p in fits)
                bound = step_time(model, memory_features.fastest_variant(lay), cluster, global_batch)[0]
                plain_ties = sum(p.step_time_s * lo <= times[0] * hi and not memory_features.features_of(p.layout) for p in fits)
                can_tie = bound * lo <= times[0] * hi
                if bound >= times[0] and (plain_ties >= top_k or (not can_tie and bound >= times[top_k - 1])):
                    skipped += 1
                    continue
            found, lean = memory_features.variants(model, lay, cluster.usable_bytes, host_usable, estimate_of)
            if not found:  # the leanest need, with or without the features
                leanest = _leaner(_leaner(leanest, lay, est.total_bytes), lean[0], lean[1].total_bytes)
                break
            fits += [evaluate(model, v, cluster, global_batch, e.total_bytes, e.host_bytes) for v, e in found]
    return skipped, leanest


def _leaner(leanest: Optional[tuple[Layout, float]], lay: Layout, mem: float) -> tuple[Layout, float]:
    return (lay, mem) if leanest is None or mem < leanest[1] else leanest


def lean_fit(
    model: ModelConfig, cluster: Cluster, global_batch: int, precision: str = "bf16", features: bool = False
) -> Optional[tuple[Layout, float]]:
    """Some layout on at most ``cluster.gpus`` GPUs that fits, searching only the memory-lean corner.

    Full recompute, micro batch 1, ZeRO-3 without PP or ZeRO-1 with PP in (2, 4, 8), every TP and every DP
    that divides the global batch; with ``features`` also each one's leanest memory features (optimizer offload,
    every layer offloaded: memory_features.leanest_variant). The candidate set only grows with the GPU count, so
    fitting is monotone.
    """
    host_usable = cluster.gpu.host_memory_bytes * memory_features.HOST_MEMORY_FRACTION
    pps = [pp for pp in (1, 2, 4, 8) if model.num_layers % pp == 0]
    dps = sorted(divisors(global_batch), reverse=True)
    for tp in sorted(valid_tps(model, cluster.gpus_per_node), reverse=True):
        for pp in pps:
            for dp in dps:
                if tp * pp * dp > cluster.gpus:
                    continue
                zero = (3 if pp == 1 else 1) if dp > 1 else 0
                lay = Layout(
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    num_microbatches=global_batch // dp,
                    sequence_parallel=sequence_parallel(model, tp),
                    recompute="full",
                    zero_stage=zero,
                    precision=precision,
                )
                mem = worst_memory(model, lay)
                if mem <= cluster.usable_bytes:
                    return lay, mem
                if features:
                    lean = memory_features.leanest_variant(model, lay)
                    est = worst_estimate(model, lean)
                    if memory_features.fits(est, cluster.usable_bytes, host_usable):
                        return lean, est.total_bytes
    return None


def family_member(base: ModelConfig, hidden: int, layers: int) -> ModelConfig:
    """The preset's family at another size: same head dim, heads per hidden unit (hidden / heads is the head dim
    unless --kv-channels sets another), key/value groups, ffn ratio (rounded to 256), vocab."""
    heads = max(1, hidden * base.num_attention_heads // base.hidden_size)
    kv = min(base.kv_heads, heads) if base.group_query_attention else heads
    ffn = int(round(base.ffn_size / base.hidden_size * hidden / 256)) * 256
    return dataclasses.replace(
        base,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=kv if base.group_query_attention else None,
        ffn_hidden_size=ffn,
    )


def max_model(base: ModelConfig, cluster: Cluster, global_batch: int, precision: str = "bf16") -> Optional[dict]:
    """Largest member of ``base``'s family (layers in steps of 8, hidden in steps of 1024) that fits."""
    best: Optional[dict] = None
    for hidden in range(1024, 65536 + 1, 1024):
        if hidden % base.head_dim:
            continue
        lo, hi = 0, 512 // 8  # layers = 8 * k; fitting shrinks as k grows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if lean_fit(family_member(base, hidden, 8 * mid), cluster, global_batch, precision):
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            break  # a wider model will not fit either
        model = family_member(base, hidden, 8 * lo)
        n = total_params(model)
        if best is None or n > best["params"]:
            lay, mem = lean_fit(model, cluster, global_batch, precision)  # type: ignore[misc]
            best = dict(
                num_layers=model.num_layers,
                hidden_size=hidden,
                num_attention_heads=model.num_attention_heads,
                num_query_groups=model.kv_heads,
                ffn_hidden_size=model.ffn_size,
                params=n,
                layout=dict(tp=lay.tp, pp=lay.pp, dp=lay.dp, zero_stage=lay.zero_stage, recompute="full", micro_batch=1),
                memory_gb=round(mem / GiB, 2),
                gpus_used=lay.world_size,
            )
    return best


# ---------------------------------------------------------------- command line


def layout_text(lay: Layout) -> str:
    zero = f"ZeRO-{lay.zero_stage}" if lay.zero_stage else "no distributed optimizer"
    split = (
        "" if lay.first_stage_layers is None else f" (first/last stage {lay.first_stage_layers}/{lay.last_stage_layers} layers)"
    )
    return (
        f"TP {lay.tp}, PP {lay.pp}{split}, VPP {lay.vpp}, CP {lay.cp}{f' ({lay.cp_comm_type})' if lay.cp > 1 else ''}, DP {lay.dp}{f' (EP {lay.ep})' if lay.ep > 1 else ''}, "
        f"micro batch {lay.micro_batch}, "
        f"{zero}, recompute {recompute_text(lay)}"
        + (f", schedule {lay.schedule}" if lay.schedule != "1f1b" else "")
        + (f", memory features {features_text(lay)}" if memory_features.features_of(lay) else "")
    )


def features_text(lay: Layout) -> str:
    """The memory features of a layout, comma-separated, or "none" (memory_features.py)."""
    return ",".join(memory_features.features_of(lay)) or "none"


def recompute_text(lay: Layout) -> str:
    if lay.recompute == "selective":
        return "sel:" + "+".join(m.replace("core_attn", "attn") for m in lay.recompute_modules)
    return lay.recompute or "none"
