"""What the memory features cost in the step-time model (step_time.py): the host link, the host's AdamW, the
optimizer's HBM traffic in its stored dtypes. Nothing here is calibrated: no published run of calibration.py
offloads, so these are assumptions, stated with their figures (hardware.py has the host table).

- Activation offload (--cpu-offloading-num-layers; parallel/offload.py): each offloaded unit of a microbatch
  (stage_activations.py: a layer, or a full-recompute group) crosses the host link twice, to host when its forward
  ends and back when the backward reaches the unit after it. The copy to host runs on a side stream beside the next
  unit's forward, the copy back beside this unit's successor's backward: per unit only max(0, transfer - that
  compute) shows. Link: ``hardware.GPUSpec.host_link_bytes_per_s`` x ``BUS_EFFICIENCY["pcie"]``, one direction
  each way (PCIe is full duplex), every GPU its own x16 link (a node whose GPUs share a PCIe switch's uplink to
  the host halves it: not modelled).
- --optimizer-cpu-offload (parallel/optimizer.py, shard_state.py): per step the owned gradients go to host (fp32,
  4 bytes per element), the host steps AdamW, and each bucket's new values come back (the parameters' bytes) while
  the next bucket steps - so gradients down, then the larger of the host's step and the copies back. The host's
  fused AdamW streams ``host_step_bytes`` per element through host memory at HOST_STEP_EFFICIENCY of this GPU's
  share of the node's memory bandwidth (an eighth of a DGX's).
- The device's AdamW (no offload) streams ``optimizer_hbm_bytes`` per owned element through HBM: the gradient
  read, the master and both moments read and written in their stored dtypes (--use-precision-aware-optimizer),
  the 16-bit parameter written.
No collectives, no device work.
"""

from __future__ import annotations

from tricorn.config import ModelConfig
from tricorn.planning.activations import TRICORN, activation_element_bytes
from tricorn.planning.hardware import BUS_EFFICIENCY, GPUSpec
from tricorn.planning.layout import Layout
from tricorn.planning.memory import DTYPE_BYTES, optimizer_bytes_per_param
from tricorn.planning.stage_activations import chunk_units, stage_units

HOST_STEP_EFFICIENCY = 0.5  # assumption: the host's fused AdamW reaches half its memory bandwidth share
OPTIMIZER_BYTES_PER_PARAM = 32  # the device's AdamW per owned element, fp32 master and moments


def host_link(gpu: GPUSpec) -> float:
    """Bytes/s one GPU moves to or from pinned host memory (one direction)."""
    return gpu.host_link_bytes_per_s * BUS_EFFICIENCY["pcie"]


def optimizer_hbm_bytes(lay: Layout) -> float:
    """Bytes the device's AdamW streams per owned element: OPTIMIZER_BYTES_PER_PARAM with fp32 masters and moments
    (the gradient read, master and moments read and written, the parameter written, and slack), less what 16-bit
    masters and moments save on being read and written (--use-precision-aware-optimizer)."""
    master, moments = DTYPE_BYTES[lay.main_params_dtype], optimizer_bytes_per_param(lay)
    return OPTIMIZER_BYTES_PER_PARAM - 2 * (4 - master) - 2 * (8 - moments)


def host_step_bytes(lay: Layout) -> float:
    """Bytes the host's AdamW streams per owned element: the fp32 gradient read, master and moments read and
    written, the staging copy of the new value written."""
    return (
        4 + 2 * DTYPE_BYTES[lay.main_params_dtype] + 2 * optimizer_bytes_per_param(lay) + activation_element_bytes(lay.precision)
    )


def offloaded_optimizer_seconds(lay: Layout, gpu: GPUSpec, owned: float) -> float:
    """--optimizer-cpu-offload's step for ``owned`` elements (module docstring)."""
    link = host_link(gpu)
    down = owned * 4 / link
    step = owned * host_step_bytes(lay) / (gpu.host_memory_bytes_per_s * HOST_STEP_EFFICIENCY)
    back = owned * activation_element_bytes(lay.precision) / link
    return down + max(step, back)


def activation_offload_seconds(
    model: ModelConfig, lay: Layout, gpu: GPUSpec, stage: int, layers: int, forward_s: float, backward_s: float
) -> float:
    """Exposed seconds per microbatch of a stage's offloaded units; ``forward_s`` / ``backward_s``: one layer's
    compute (module docstring)."""
    if lay.offload_layers == 0 or layers == 0:
        return 0.0
    chunks = lay.vpp if lay.pp > 1 else 1
    per_chunk = layers // chunks
    units = chunk_units(model, lay, per_chunk, TRICORN)
    n = units.offloaded * chunks
    if n == 0:
        return 0.0
    moved = stage_units(model, lay, stage, layers, TRICORN).host / n  # bytes per unit
    layers_per_unit = per_chunk / len(units.units)
    transfer = moved / host_link(gpu)
    return n * (max(0.0, transfer - layers_per_unit * forward_s) + max(0.0, transfer - layers_per_unit * backward_s))
