"""Predicted seconds per training iteration of a layout on a cluster, for ranking layouts in `tricorn plan`.

The shape of the model is fixed below; four efficiencies per GPU type (``Efficiency``) are fitted to published
runs by tricorn/planning/calibration.py and stored in tricorn/planning/data/step_time_calibration.json.
- compute: each GEMM of a microbatch on a rank takes FLOPs / (peak * gemm * k / (k + HALF_DIM)), k the smallest
  GEMM dimension - small matmuls (thin TP shards, short microbatches) run further from peak. The attention core
  runs at ``attention`` x b / (b + HALF_DIM), b the length of the query/key blocks (s, or s / 2CP under CP's
  load-balanced chunks). Backward costs 2x the GEMMs' forward and 2.5x the attention core's (flash recomputes
  Q K^T). Memory-bound work (norms, RoPE, activations, casts) adds ELEMENTWISE_OVERHEAD of the GEMM time.
- FP8 (--fp8-format, either engine): the four linears' GEMMs run at the FP8 peak, the attention core and the
  head at the 16-bit one (``_peaks``); each layer adds its FP8 casts, memory-bound (``fp8_cast_bytes``). Not
  calibrated: the published runs of calibration.py are bf16/fp16.
- recompute: full re-runs the layer's forward; selective re-runs the modules named (core_attn: the attention
  core; mlp: the MLP's up projection and activation; norm: the two norms, memory-bound).
- TP: with SP, 4 all-gathers / reduce-scatters of the [tokens, h] activation per layer forward and 4 backward
  (4 more with full recompute, 1 more when selective recompute re-gathers the MLP input), at ``nvlink`` x the
  NVLink rate; not overlapped with compute unless the run overlaps them (``RunFeatures.tp_comm_overlap``).
- CP: each layer passes K and V around the ring in CP - 1 steps (forward, and twice that backward); a step's
  transfer hides behind that step's attention block. The ring runs over NVLink when TP x CP fits in a node.
- PP: the slowest stage's per-microbatch time t (stages hold --decoder-first/last-pipeline-num-layers where
  given, the rest split evenly; the last also runs the head); the pipeline takes t * (M + (PP - 1) / V) for M
  microbatches and V virtual stages (the bubble), plus the point-to-point sends.
- DP: gradients are reduce-scattered (distributed optimizer) or all-reduced, and ZeRO-1/2 all-gather the
  16-bit parameters after the optimizer step (the four linears' weights in FP8 with --fp8-param-gather, half the bytes), at ``network`` x the network rate when the group leaves the node.
  With --overlap-grad-reduce the reduction hides behind the backward except the last layer's bucket; with
  --overlap-param-gather the gather hides behind the first forward likewise. ZeRO-2 reduces every microbatch.
  ZeRO-3 gathers each layer's parameters in forward and again in backward and reduce-scatters its gradients,
  prefetching the next layer while one computes: per layer only max(0, transfer - compute) shows, plus the
  first layer's gather; there is no gather after the step.
- EP (MoE): the all_to_alls of ``ep_all_to_all_bytes`` (each token once per other rank holding one of its
  experts) at the rate of the ep group's link, not overlapped; the MoE MLP's GEMMs are those of the k active
  experts (``mlp_width_per_rank``).
- optimizer: AdamW streams ~32 bytes per (sharded) parameter through HBM, fewer with 16-bit moments or masters
  (--use-precision-aware-optimizer); with --optimizer-cpu-offload the host steps instead (host_time.py).
- activation offload (host_time.py, an assumption, not calibrated): its copies to and from host show where they
  outlast the compute beside them.
No collectives, no device work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from tricorn.config import ModelConfig
from tricorn.planning.context_comm import cp_traffic
from tricorn.planning.efficiency import Efficiency, efficiency_for
from tricorn.planning.hardware import GPUSpec
from tricorn.planning.host_time import activation_offload_seconds, offloaded_optimizer_seconds, optimizer_hbm_bytes
from tricorn.planning.layout import Layout
from tricorn.planning.memory import (
    FP8_PARAM_BYTES,
    activation_element_bytes,
    fp8_primary_elements,
    stage_layer_counts,
    stage_params_per_rank,
)

HALF_DIM = 128  # a GEMM or attention block this small in its smallest dimension runs at half its large-size speed
ELEMENTWISE_OVERHEAD = 0.15


@dataclass(frozen=True)
class RunFeatures:
    """What a run overlaps. tricorn's trainer: grad reduce and param gather overlapped, TP comm not."""

    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: GPUSpec
    peak_tflops: float
    memory_margin: float = 0.10
    efficiency: Optional[Efficiency] = None  # None: the calibrated factors of this GPU type

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_bytes * (1 - self.memory_margin)

    @property
    def eff(self) -> Efficiency:
        if self.efficiency is not None:
            return self.efficiency
        return efficiency_for(self.gpu.name)


@dataclass
class _Layer:
    """Seconds of one layer for one microbatch on one rank."""

    fwd: float = 0.0  # compute of the forward
    total: float = 0.0  # compute of forward + backward + recompute, with elementwise work
    tp_comm: float = 0.0
    cp_exposed: float = 0.0
    ep_comm: float = 0.0  # MoE all_to_alls, not overlapped
    parts: dict = field(default_factory=dict)


def mlp_width_per_rank(model: ModelConfig, tp: int, sequence_parallel: bool = False, etp: int = 1) -> float:
    """The MLP inner width one token meets on one TP rank, averaged over the layers (MoE: active experts, which
    under SP see only the rank's 1/TP of the tokens, or with expert TP all tokens through 1/TP of each expert:
    as if TP-split either way)."""
    widths = []
    routed_div = tp if sequence_parallel or etp > 1 else 1
    for i in range(model.num_layers):
        if model.is_moe_layer(i):
            routed = model.moe_router_topk * model.moe_ffn_size / routed_div
            widths.append(routed + (model.moe_shared_expert_intermediate_size or 0) / tp)
        else:
            widths.append(model.ffn_size / tp)
    return sum(widths) / len(widths)


def ep_rows_per_token(model: ModelConfig, ep: int) -> float:
    """Other ranks a token is sent to under expert parallelism (parallel/expert.py sends it once per rank holding
    one of its k experts), for balanced routing: (EP - 1) x P(one of its experts is on a given rank)."""
    n, k = model.num_experts, model.moe_router_topk
    return (ep - 1) * (1 - math.comb(n - n // ep, k) / math.comb(n, k))


def ep_all_to_all_bytes(model: ModelConfig, lay: Layout, tokens: float) -> float:
    """Bytes one rank sends in a layer's MoE all_to_alls per microbatch (mean over layers): each token's hidden
    state once per other rank holding one of its experts (``ep_rows_per_token``), dispatched and combined in
    forward and again in backward (4 transfers; 6 with full recompute), and with each row its routing weights
    for that rank's E/EP experts (fp32) and their gradients (2 transfers; 3). Under SP a rank dispatches only its
    sequence shard (1/TP of the tokens) at ETP 1; at ETP = TP the shards gathered over TP (all the tokens)."""
    if model.num_experts is None or lay.ep == 1:
        return 0.0
    tokens = tokens / (lay.tp if lay.sequence_parallel and lay.etp == 1 else 1)
    moe_fraction = sum(model.is_moe_layer(i) for i in range(model.num_layers)) / model.num_layers
    full = lay.recompute == "full"
    row = (6 if full else 4) * model.hidden_size * activation_element_bytes(lay.precision)
    row += (3 if full else 2) * 4 * model.num_experts // lay.ep
    return moe_fraction * tokens * ep_rows_per_token(model, lay.ep) * row


def _gemm_time(flops: float, smallest: float, peak: float, eff: float) -> float:
    return flops / (peak * eff * smallest / (smallest + HALF_DIM))


def _link(cluster: Cluster, group_stride: int, group_size: int) -> float:
    """Bytes/s per rank of a collective over ``group_size`` ranks ``group_stride`` apart."""
    if group_stride * group_size <= cluster.gpus_per_node:
        return cluster.gpu.nvlink_bytes_per_s * cluster.eff.nvlink
    return cluster.gpu.network_bytes_per_s * cluster.eff.network


def _peaks(lay: Layout, cluster: Cluster) -> tuple[float, float]:
    """FLOP/s of (the decoder's four linears, all other compute). Under FP8 ``cluster.peak_tflops`` is the FP8 peak
    (what MFU is measured against, as in the trainer's log) and only the linears run in FP8, on either engine:
    the attention core and the head run at the 16-bit rate, the GPU table's bf16 / fp8 ratio of it."""
    peak = cluster.peak_tflops * 1e12
    if lay.fp8_recipe is None:
        return peak, peak
    return peak, peak * cluster.gpu.peak_tflops("bf16") / cluster.gpu.peak_tflops("fp8")


def fp8_cast_bytes(model: ModelConfig, lay: Layout, tokens: float) -> float:
    """HBM bytes of one layer's FP8 casts per microbatch on a rank (0 without FP8): each linear's input in forward
    (QKV's and w1's as the sequence shard under SP) and each linear's output gradient in backward, read in the
    16-bit dtype and written in FP8. The weights' casts, once per global batch, are left out (1/M of that)."""
    if lay.fp8_recipe is None:
        return 0.0
    h, gd, tp = model.hidden_size, model.kv_heads * model.head_dim, lay.tp
    q, sp_div = model.num_attention_heads * model.head_dim, tp if lay.sequence_parallel else 1
    f = mlp_width_per_rank(model, tp, lay.sequence_parallel, lay.etp)
    up = f * (2 if model.swiglu else 1)
    forward = 2 * h / sp_div + q / tp + f
    backward = (q + 2 * gd) / tp + up + 2 * h / sp_div
    return tokens * (forward + backward) * (activation_element_bytes(lay.precision) + 1)


def _layer(model: ModelConfig, lay: Layout, cluster: Cluster, features: RunFeatures) -> _Layer:
    (peak, peak16), eff = _peaks(lay, cluster), cluster.eff
    h, gd, tp, cp = model.hidden_size, model.kv_heads * model.head_dim, lay.tp, lay.cp
    q = model.num_attention_heads * model.head_dim
    e = activation_element_bytes(lay.precision)
    tokens = lay.micro_batch * model.seq_length / cp  # per rank per microbatch
    f = mlp_width_per_rank(model, tp, lay.sequence_parallel, lay.etp)  # MoE: the active width (k experts + shared expert)
    up = f * (2 if model.swiglu else 1)
    qkv = _gemm_time(2 * tokens * h * (q + 2 * gd) / tp, min(tokens, (q + 2 * gd) / tp, h), peak, eff.gemm)
    proj = _gemm_time(2 * tokens * q * h / tp, min(tokens, h, q / tp), peak, eff.gemm)
    mlp_up = _gemm_time(2 * tokens * h * up, min(tokens, up, h), peak, eff.gemm)
    mlp_down = _gemm_time(2 * tokens * f * h, min(tokens, h, f), peak, eff.gemm)
    gemm_fwd = qkv + proj + mlp_up + mlp_down
    block = model.seq_length / (2 * cp) if cp > 1 else model.seq_length  # CP's load-balanced query/key chunks
    # Every query against all keys of the sequence (the calibration's causal attention), scaled by the pairs a
    # window and documents leave (flops.attention_work; masking.py never calls a block no document spans).
    core_flops = 4 * tokens * model.seq_length * q / tp * lay.attention_work
    core_fwd = core_flops / (peak16 * eff.attention * block / (block + HALF_DIM))
    norm_fwd = 2 * 2 * tokens * h * e / (tp if lay.sequence_parallel else 1) / cluster.gpu.hbm_bytes_per_s
    if lay.recompute == "full":
        recompute = gemm_fwd + core_fwd
    elif lay.recompute == "selective":
        mods = lay.recompute_modules
        recompute = core_fwd * ("core_attn" in mods) + mlp_up * ("mlp" in mods) + norm_fwd * ("norm" in mods)
    else:
        recompute = 0.0
    total = (3 * gemm_fwd + 3.5 * core_fwd) * (1 + ELEMENTWISE_OVERHEAD) + recompute * (1 + ELEMENTWISE_OVERHEAD)
    total += fp8_cast_bytes(model, lay, tokens) / cluster.gpu.hbm_bytes_per_s
    out = _Layer(fwd=(gemm_fwd + core_fwd) * (1 + ELEMENTWISE_OVERHEAD), total=total)
    if tp > 1:
        collectives = 8 + (4 if lay.recompute == "full" else 0)
        if lay.recompute == "selective" and "mlp" in lay.recompute_modules and lay.sequence_parallel:
            collectives += 1  # the MLP input is all-gathered again
        if lay.etp > 1:  # expert TP: the tokens in and the experts' outputs out of each MoE layer, both directions
            collectives += 4 * sum(model.is_moe_layer(i) for i in range(model.num_layers)) / model.num_layers
        tp_comm = collectives * tokens * h * e * (tp - 1) / tp / _link(cluster, 1, tp)
        # An overlapped TP collective hides behind its GEMM; what is longer than the GEMM shows.
        out.tp_comm = max(0.0, tp_comm - 3 * gemm_fwd) if features.tp_comm_overlap else tp_comm
    if lay.ep > 1:
        out.ep_comm = ep_all_to_all_bytes(model, lay, tokens) / _link(cluster, tp * cp, lay.ep)
    if cp > 1 and lay.cp_comm_type == "p2p":
        # Each of the CP - 1 ring steps sends one K, V chunk while computing one block (forward; backward 2x both).
        step_comm = 2 * tokens * gd / tp * e / _link(cluster, tp, cp)
        out.cp_exposed = 3 * (cp - 1) * max(0.0, step_comm - core_fwd / cp)
    elif cp > 1:  # a2a and allgather: nothing overlaps their collectives (planning/context_comm.py)
        out.cp_exposed = cp_traffic(model, lay).bytes(e) / _link(cluster, tp, cp)
    return out


def _head_time(model: ModelConfig, lay: Layout, cluster: Cluster) -> float:
    tokens = lay.micro_batch * model.seq_length / lay.cp
    vocab = model.padded_vocab_size(lay.tp)
    flops = 2 * tokens * model.hidden_size * vocab / lay.tp
    g = _gemm_time(flops, min(tokens, vocab / lay.tp, model.hidden_size), _peaks(lay, cluster)[1], cluster.eff.gemm)
    return 3 * g * (1 + ELEMENTWISE_OVERHEAD)


def _exposed(transfer: float, window: float, floor: float) -> float:
    """Time of a transfer not hidden behind ``window`` of compute; ``floor`` (the last bucket) never hides."""
    return max(floor, transfer - window)


def _dp_time(
    model: ModelConfig, lay: Layout, cluster: Cluster, features: RunFeatures, layer: _Layer, layers: int, per_mb: float
) -> float:
    """Exposed seconds of the data-parallel (DP x CP) traffic in one iteration."""
    shard = lay.dp * lay.cp
    if shard == 1:
        return 0.0
    params = stage_params_per_rank(model, lay, 0, layers)
    grad_bytes = 2 if lay.grads_16bit else 4
    param_bytes = 2 if lay.precision != "fp32" else 4
    fp8 = fp8_primary_elements(model, lay, layers)  # --fp8-param-gather: these gather at FP8_PARAM_BYTES
    link = _link(cluster, lay.tp, shard)
    frac = (shard - 1) / shard
    rs = frac * params * grad_bytes / link
    ag = frac * ((params - fp8) * param_bytes + fp8 * FP8_PARAM_BYTES) / link
    m, n = lay.num_microbatches, max(layers, 1)
    bwd_window = per_mb * 2 / 3 if features.overlap_grad_reduce else 0.0
    fwd_window = per_mb / 3 if features.overlap_param_gather else 0.0
    if lay.zero_stage == 0:
        return _exposed(2 * rs, bwd_window, 2 * rs / n)
    if lay.zero_stage == 1:
        return _exposed(rs, bwd_window, rs / n) + _exposed(ag, fwd_window, ag / n)
    if lay.zero_stage == 2:
        return m * _exposed(rs, bwd_window, rs / n) + _exposed(ag, fwd_window, ag / n)
    # ZeRO-3: per layer, gather (forward), gather + reduce-scatter (backward), the next layer's prefetched.
    ag_l, rs_l = ag / n, rs / n
    bwd_compute = layer.total - layer.fwd
    fwd = ag_l + (n - 1) * max(0.0, ag_l - layer.fwd)
    bwd = ag_l + rs_l + (n - 1) * max(0.0, ag_l + rs_l - bwd_compute)
    return m * (fwd + bwd)


# The W share of a microbatch's forward + backward in the zero-bubble model: F, B (input gradient) and W
# (weight gradients) cost about the same, as in Qi et al. (a backward is two forward-sized GEMMs per linear).
ZB_WEIGHT_SHARE = 1 / 3


def pipeline_bubble(per_mb: float, lay: Layout) -> float:
    """Idle seconds per iteration of the slowest stage; ``per_mb`` is its forward + backward of one microbatch.

    1F1B / interleaved: (pp - 1) per_mb / vpp. zb-h1: (pp - 1)(T_F + T_B - T_W) = (pp - 1) per_mb / 3. zbv and
    dualpipev (2 chunks of half a stage): (pp - 1) per_mb / 6 once m >= 2 pp, zb-h1's figure below that. These
    are the unit-time simulator's idle times (tests/test_pipeline_zero_bubble.py); gpipe is 1F1B's."""
    p, m = lay.pp, lay.num_microbatches
    if lay.schedule == "zb-h1":
        return per_mb * (p - 1) * ZB_WEIGHT_SHARE
    if lay.schedule in ("zbv", "dualpipev"):
        return per_mb * (p - 1) * ZB_WEIGHT_SHARE / (2 if m >= 2 * p else 1)
    return per_mb * (p - 1) / lay.vpp


def step_time(
    model: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int, features: RunFeatures = RunFeatures()
) -> tuple[float, dict]:
    """(seconds per iteration, breakdown in seconds) of ``layout``; ``global_batch`` is implied by the layout."""
    lay = layout
    layer = _layer(model, lay, cluster, features)
    per_layer = layer.total + layer.tp_comm + layer.cp_exposed + layer.ep_comm
    head = _head_time(model, lay, cluster)
    counts = stage_layer_counts(model.num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    head_at = lay.head_stage if len(counts) == lay.pp else len(counts) - 1
    # Activation offload: what each stage's copies to and from host do not hide behind its compute (host_time.py).
    offload = [
        activation_offload_seconds(model, lay, cluster.gpu, i, c, layer.fwd, layer.total - layer.fwd)
        for i, c in enumerate(counts)
    ]
    stage_times = [c * per_layer + (head if i == head_at else 0.0) + offload[i] for i, c in enumerate(counts)]
    slowest = max(range(len(counts)), key=lambda i: stage_times[i])
    per_mb = stage_times[slowest]
    m, v = lay.num_microbatches, lay.vpp
    bubble = pipeline_bubble(per_mb, lay)
    p2p = 0.0
    if lay.pp > 1:
        act_bytes = lay.micro_batch * model.seq_length / lay.cp * model.hidden_size * activation_element_bytes(lay.precision)
        act_bytes /= lay.tp if lay.sequence_parallel else 1
        p2p = 2 * v * m * act_bytes / _link(cluster, lay.tp * lay.cp * lay.dp, 2)
    layers = counts[slowest]
    dp = _dp_time(model, lay, cluster, features, layer, max(counts), per_mb)
    opt_shard = lay.dp * lay.cp if lay.zero_stage else 1
    params = stage_params_per_rank(model, lay, 0, max(counts))
    if lay.optimizer_offload:  # the host steps: gradients down, AdamW on the host, the new values back
        optimizer = offloaded_optimizer_seconds(lay, cluster.gpu, params / opt_shard)
    else:
        optimizer = params * optimizer_hbm_bytes(lay) / opt_shard / cluster.gpu.hbm_bytes_per_s
    total = per_mb * m + bubble + p2p + dp + optimizer
    breakdown = dict(
        compute_s=m * (layers * layer.total + (per_mb - layers * per_layer - offload[slowest])),
        offload_exposed_s=m * offload[slowest],
        tp_comm_s=m * layers * layer.tp_comm,
        cp_exposed_s=m * layers * layer.cp_exposed,
        ep_all_to_all_s=m * layers * layer.ep_comm,
        pipeline_bubble_s=bubble,
        p2p_s=p2p,
        dp_exposed_s=dp,
        optimizer_s=optimizer,
    )
    return total, breakdown
