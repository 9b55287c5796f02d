"""Predicted seconds per training iteration of a layout on a cluster, for ranking layouts in `tricorn plan`.

All constants are below, the GPU figures in hardware.py.
- compute: each GEMM of a microbatch on a rank takes FLOPs / (peak * eff), with
  eff = GEMM_EFFICIENCY * k / (k + GEMM_HALF_DIM), k the smallest GEMM dimension - small matmuls (thin TP
  shards, short microbatches) run further from peak. Backward costs 2x forward, full recompute adds a forward,
  selective an attention core; flash attention runs at ATTENTION_EFFICIENCY and its backward is 2.5x forward.
  Memory-bound work (norms, RoPE, activations, casts) adds ELEMENTWISE_OVERHEAD of the GEMM time.
- TP: with SP, 4 all-gathers / reduce-scatters of the [tokens, h] activation per layer forward and 4 backward
  (4 more with full recompute), over NVLink at the bus efficiency; not overlapped with compute.
- CP: each layer passes K and V around the ring in CP - 1 steps (forward, and twice that backward); a step's
  transfer overlaps only with that step's attention block, and the split attention runs CP_ATTENTION_PENALTY
  slower per extra CP rank. The ring runs over NVLink when TP x CP fits in a node.
- PP: per-microbatch stage time t (the slowest stage: the last one also runs the head); the pipeline takes
  t * (M + (PP - 1) / V) for M microbatches and V virtual stages (the bubble), plus the point-to-point sends.
- DP: gradients are reduce-scattered (distributed optimizer) or all-reduced, and the distributed optimizer
  all-gathers the 16-bit parameters, over the network when the DP group leaves the node. The reduction
  overlaps with the last microbatch's backward and the gather with the first forward, but at most DP_OVERLAP
  of a transfer ever hides; ZeRO-2 reduces every microbatch, ZeRO-3 also gathers parameters for every forward
  and backward (so they cost more than ZeRO-1 and win only where memory demands them).
- optimizer: AdamW streams ~OPTIMIZER_BYTES_PER_PARAM bytes per (sharded) parameter through HBM.
No collectives, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass

from tricorn.config import ModelConfig
from tricorn.planning.hardware import BUS_EFFICIENCY, GPUSpec
from tricorn.planning.memory import Layout, activation_element_bytes, stage_params_per_rank

GEMM_EFFICIENCY = 0.75
GEMM_HALF_DIM = 128
ATTENTION_EFFICIENCY = 0.50
CP_ATTENTION_PENALTY = 0.15
ELEMENTWISE_OVERHEAD = 0.15
DP_OVERLAP = 0.8
OPTIMIZER_BYTES_PER_PARAM = 32


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: GPUSpec
    peak_tflops: float
    memory_margin: float = 0.10

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_bytes * (1 - self.memory_margin)


def _gemm_time(flops: float, m: float, n: float, k: float, peak: float) -> float:
    smallest = min(m, n, k)
    return flops / (peak * GEMM_EFFICIENCY * smallest / (smallest + GEMM_HALF_DIM))


def _link(cluster: Cluster, group_stride: int, group_size: int) -> float:
    """Bytes/s per rank of a collective over ``group_size`` ranks ``group_stride`` apart."""
    if group_stride * group_size <= cluster.gpus_per_node:
        return cluster.gpu.nvlink_bytes_per_s * BUS_EFFICIENCY["nvlink"]
    return cluster.gpu.network_bytes_per_s * BUS_EFFICIENCY["network"]


def _exposed(transfer: float, window: float) -> float:
    """Time of a transfer not hidden behind ``window`` of compute: at most DP_OVERLAP of it ever hides."""
    return max(transfer * (1 - DP_OVERLAP), transfer - window)


def step_time(model: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int) -> tuple[float, dict]:
    lay, peak = layout, cluster.peak_tflops * 1e12
    h, f, gd, tp = model.hidden_size, model.ffn_size, model.kv_heads * model.head_dim, lay.tp
    e = activation_element_bytes(lay.precision)
    tokens = lay.micro_batch * model.seq_length / lay.cp  # per rank per microbatch
    up = f * (2 if model.swiglu else 1)
    gemms = [  # (forward FLOPs, m, n, k) of one layer for one microbatch on one rank
        (2 * tokens * h * (h + 2 * gd) / tp, tokens, (h + 2 * gd) / tp, h),
        (2 * tokens * h * h / tp, tokens, h, h / tp),
        (2 * tokens * h * up / tp, tokens, up / tp, h),
        (2 * tokens * f * h / tp, tokens, h, f / tp),
    ]
    gemm_fwd = sum(_gemm_time(*g, peak) for g in gemms)
    core_flops = 4 * tokens * model.seq_length * h / tp  # every query against all keys of the sequence
    # Ring attention runs CP smaller kernels per layer plus the softmax merges between them.
    core_fwd = core_flops / (peak * ATTENTION_EFFICIENCY) * (1 + CP_ATTENTION_PENALTY * (lay.cp - 1))
    recompute_fwd = {None: 0.0, "selective": core_fwd, "full": gemm_fwd + core_fwd}[lay.recompute]
    layer = (3 * gemm_fwd + 3.5 * core_fwd + recompute_fwd) * (1 + ELEMENTWISE_OVERHEAD)
    vocab = model.padded_vocab_size(tp)
    head = 3 * _gemm_time(2 * tokens * h * vocab / tp, tokens, vocab / tp, h, peak) * (1 + ELEMENTWISE_OVERHEAD)

    tp_bytes = tokens * h * e * (tp - 1) / tp
    tp_collectives = 8 + (4 if lay.recompute == "full" else 0)
    tp_comm = tp_collectives * tp_bytes / _link(cluster, 1, tp) if tp > 1 else 0.0
    cp_exposed = 0.0
    if lay.cp > 1:
        # Each of the CP - 1 ring steps sends one K, V chunk while computing one block (forward; backward 2x both).
        step_comm = 2 * tokens * gd / tp * e / _link(cluster, tp, lay.cp)
        cp_exposed = 3 * (lay.cp - 1) * max(0.0, step_comm - core_fwd / lay.cp)

    layers_per_stage = model.num_layers / lay.pp
    stage = layers_per_stage * (layer + tp_comm + cp_exposed)
    per_microbatch = stage + (head if lay.pp > 1 else 0.0)  # the last stage also runs the head
    if lay.pp == 1:
        per_microbatch = stage + head
    m, v = lay.num_microbatches, lay.vpp
    pipeline = per_microbatch * (m + (lay.pp - 1) / v)
    p2p = 0.0
    if lay.pp > 1:
        act_bytes = tokens * h * e / (tp if lay.sequence_parallel else 1)
        p2p = 2 * v * m * act_bytes / _link(cluster, tp * lay.cp * lay.dp, 2)

    shard = lay.dp * lay.cp
    params = stage_params_per_rank(model, lay, 0, int(layers_per_stage))
    grad_bytes = 2 if lay.grads_16bit else 4
    param_bytes = 2 if lay.precision != "fp32" else 4
    dp_exposed = 0.0
    if shard > 1:
        link = _link(cluster, tp, shard)
        frac = (shard - 1) / shard
        fwd_window, bwd_window = per_microbatch / 3, 2 * per_microbatch / 3
        rs = frac * params * grad_bytes / link
        ag = frac * params * param_bytes / link
        if lay.zero_stage == 0:
            dp_exposed = _exposed(2 * rs, bwd_window)
        elif lay.zero_stage == 1:
            dp_exposed = _exposed(rs, bwd_window) + _exposed(ag, fwd_window)
        else:  # ZeRO-2 reduces every microbatch's gradients; ZeRO-3 also gathers parameters for each pass
            dp_exposed = m * _exposed(rs, bwd_window) + _exposed(ag, fwd_window)
            if lay.zero_stage == 3:
                dp_exposed += m * (_exposed(ag, fwd_window) + _exposed(ag, bwd_window))
    opt_shard = shard if lay.zero_stage else 1
    optimizer = params * OPTIMIZER_BYTES_PER_PARAM / opt_shard / cluster.gpu.hbm_bytes_per_s

    total = pipeline + p2p + dp_exposed + optimizer
    bubble = per_microbatch * (lay.pp - 1) / v
    breakdown = dict(
        compute_s=per_microbatch * m - m * layers_per_stage * (tp_comm + cp_exposed),
        tp_comm_s=m * layers_per_stage * tp_comm,
        cp_exposed_s=m * layers_per_stage * cp_exposed,
        pipeline_bubble_s=bubble,
        p2p_s=p2p,
        dp_exposed_s=dp_exposed,
        optimizer_s=optimizer,
    )
    return total, breakdown
