"""Activation memory, measured and predicted: a saved-tensor probe and the per-layer formula of our block.

Measured. ``ActivationProbe`` wraps every forward of the model chunks in
``torch.autograd.graph.saved_tensors_hooks`` and records each tensor autograd saves for backward, by storage
(views of one storage are counted once), attributed to the transformer layer running when it was first
saved, or to "other" (embedding, final norm, head, loss). Parameters and buffers are not activations and are
skipped. Sizes are read when the chunk's forward ends, so storage freed during forward (selective "norm"
recompute) counts as the 0 bytes it then holds. Under ``torch.utils.checkpoint`` only what the checkpoint
keeps - its inputs - reaches the probe: with full recompute a layer measures its input. Each saved tensor is
handed to autograd inside a small holder whose release (when backward frees the graph) tells the probe
which microbatches still hold activations: the peak of that count is ``peak_microbatches_in_flight``.

Predicted. Our block (pre-norm RMSNorm, fused QKV with GQA and RoPE, SDPA, out projection, SwiGLU or GeLU MLP,
optional residual dropout), one microbatch of b samples of s tokens (s after CP), hidden h, a query heads,
g key/value groups of d = h/a, r = g/a, MLP width f, TP t, element size e (4 fp32, 2 bf16/fp16). Counted
the way Korthikanti et al. 2022 count sbh(34 + 5as/h) for GPT-3 (every tensor a backward needs, in bytes):

    term                          bytes / sbh                      what autograd keeps
    norm inputs (2 norms)         2 * 4 * (1 + c)        [/t SP]   fp32 input (a cast copy in bf16); c = 1 on CPU,
                                                                   whose unfused rms_norm also keeps x*rstd in fp32
    norm statistics               2 * 4k / h             [/t SP]   fp32 rstd (k = 1) - LayerNorm: mean too (k = 2)
    linear inputs                 2e                               the norm outputs, input of QKV and of w1 (SP:
                                                                   their all-gathered copies, so not / t)
    residual dropout              2m                     [/t SP]   masks: m = 1 (bool, GPU) or e (CPU), if > 0
    fused QKV output              e(1 + 2r) / t                    v is a view of it, so SDPA keeps it whole
    RoPE'd q and k                e(1 + r) / t                     (learned positions: 0 - q, k are views of QKV)
    attention output              e / t                            SDPA's output is the out projection's input
    SDPA state (flash/efficient)  4a / (h t)                       fp32 log-sum-exp per head and token; no s x s
    MLP                           4e f/(h t) SwiGLU                gate|up output (2f), silu(gate), their product
                                  2e f/(h t) GeLU                  w1 output, gelu output
    + RoPE tables  4 e s d (cos, sin rows for q and k; not per sample, not split)
    + bf16/fp16: the fp32 copies of the two norm weights, 2 * 4h (4h more for LayerNorm's bias)

Summed, with RMSNorm, RoPE and flash attention, no dropout:

    CPU, fp32 (e = 4, c = 1):      sbh(24 + (12 + 12r + 4a/h + 4k f/h) / t) + 8sb + 16sd    k = 4 SwiGLU, 2 GeLU
    GPU, bf16 (e = 2, c = 0), SP:  sbh(4 + (14 + 6r + 8f/h + 4a/h + 8/h) / t) + 8sd           (SwiGLU)
    GPU, bf16, TP without SP:      sbh(12 + (6 + 6r + 8f/h + 4a/h) / t) + 8sb + 8sd

e.g. Llama-2-7B (r = 1, f/h = 2.69) in bf16 with SP: sbh(4 + 41.5/t), against GPT-3's sbh(34 + 5as/h)/t in
Korthikanti's accounting: no s x s term (flash), but fp32 norm inputs and the all-gathered linear inputs.

    math attention (CPU with --attention-dropout > 0, where torch's flash kernel has no dropout): instead of
    the QKV output, RoPE'd q, k and the log-sum-exp, SDPA keeps copies of q (scaled), k and v expanded to a
    heads: 3e / t, and the s x s tensors: (e [softmax] + m [mask] + e [dropped probs]) * a s / (h t) -
    Korthikanti's 5as/h term in fp16 on GPU.

Variants. TP divides everything inside the TP region (QKV ... MLP); SP also divides the norm and dropout
terms (they act on the sequence shard). Selective recompute (tricorn.parallel.recompute): core_attn removes
the SDPA state (flash: 4a/(ht); math: 3e/t and the s x s terms, while q, k, v held by the checkpoint are the
QKV and RoPE terms again); mlp removes the MLP term (under SP it also turns w1's all-gathered input, e, into
the norm output's shard the checkpoint holds, e/t); norm removes the norm outputs, 2e without SP - under SP
only the shard a checkpointed MLP would hold, since QKV and w1 keep their own all-gathered copies. Full
recompute keeps only the layer input, e*sbh (/t under SP) per group of N layers - plus, transiently during
backward, one group's full activations.

Checked: the probe equals this formula to the byte on CPU (fp32 and bf16, TP and SP, every recompute
variant; tests/test_activation_probe.py). The GPU rows assume torch's fused rms_norm (input + rstd kept),
bool dropout masks and flash / memory-efficient SDPA; they were not measured on a GPU here.
tricorn/planning/memory.py (TRICORN profile) gives the same numbers except in three places: it counts the
math attention path's s x s tensors only when its profile says so (not from --attention-dropout on CPU),
under SP it still counts w1's all-gathered input with selective "mlp" (measured: only the e/t shard stays)
and drops both all-gathered inputs with "norm" (measured: they stay), and it counts one fp32 statistic per
token for LayerNorm (which keeps two).

No collectives. Memory effect of the probe: one Python holder per saved tensor, released with the graph.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch
from torch import nn

# ---------------------------------------------------------------- formula


@dataclass(frozen=True)
class LayerActivationTerms:
    """Bytes one transformer layer keeps for backward, for one microbatch on one rank, by term."""

    norm_inputs: float = 0.0
    norm_stats: float = 0.0
    norm_weights: float = 0.0
    linear_inputs: float = 0.0
    dropout_masks: float = 0.0
    rope_tables: float = 0.0
    qkv: float = 0.0
    attention_output: float = 0.0
    attention_core: float = 0.0
    mlp: float = 0.0
    layer_input: float = 0.0  # full recompute: the checkpointed group's input, per layer

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def uses_flash_attention(device: str, attention_dropout: float) -> bool:
    """Whether torch's SDPA takes a fused path (no s x s tensor kept): on CPU only without attention dropout."""
    return device != "cpu" or attention_dropout == 0.0


def layer_activation_terms(
    model: Any,
    *,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    recompute_modules: Sequence[str] = ("core_attn",),
    recompute_num_layers: int = 1,
    precision: str = "fp32",
    device: str = "cpu",
) -> LayerActivationTerms:
    """The module docstring's formula for `model` (a ModelConfig); s = `seq` tokens on this rank (after CP)."""
    s, b, h, t = seq, micro_batch, model.hidden_size, tp
    e = 4 if precision == "fp32" else 2
    sbh = s * b * h
    sp = t if sequence_parallel and t > 1 else 1
    if recompute == "full":
        return LayerActivationTerms(layer_input=e * sbh / sp / recompute_num_layers)
    selective = set(recompute_modules) if recompute == "selective" else set()
    a, d, f = model.num_attention_heads, model.head_dim, model.ffn_size
    gd = model.kv_heads * d
    rms = model.normalization == "RMSNorm"
    mask = 1 if device != "cpu" else e
    rope = model.position_embedding_type == "rope"
    flash = uses_flash_attention(device, model.attention_dropout)
    qkv_kept = e * s * b * ((h + 2 * gd) + ((h + gd) if rope else 0))  # fused output + RoPE'd q, k
    if flash or "core_attn" in selective:
        qkv = qkv_kept
        core = 0.0 if "core_attn" in selective else 4.0 * a * s * b
    else:  # math SDPA: scaled q, k and v expanded to a heads, softmax, and with dropout its mask and output
        qkv = 3 * e * sbh
        core = (e + ((mask + e) if model.attention_dropout > 0 else 0)) * a * s * s * b
    return LayerActivationTerms(
        norm_inputs=2 * 4 * (2 if rms and device == "cpu" else 1) * sbh / sp,
        norm_stats=2 * 4 * (1 if rms else 2) * s * b / sp,
        norm_weights=0.0 if e == 4 else 2 * 4 * h * (1 if rms else 2),
        linear_inputs=_linear_inputs(e * sbh, sp, selective),
        dropout_masks=2 * mask * sbh / sp if model.hidden_dropout > 0 else 0.0,
        rope_tables=4 * e * s * d if rope else 0.0,
        qkv=qkv / t,
        attention_output=e * sbh / t,
        attention_core=core / t,
        mlp=0.0 if "mlp" in selective else e * s * b * f * (4 if model.swiglu else 2) / t,
    )


def _linear_inputs(esbh: float, sp: int, selective: set[str]) -> float:
    """The inputs of QKV and w1 (the norm outputs), as the column-parallel linears or a checkpoint keep them."""
    norm = "norm" in selective
    if sp == 1:  # the linear (or the MLP checkpoint) keeps the norm output itself; "norm" empties it
        return 0.0 if norm else 2 * esbh
    # SP: QKV keeps its all-gathered input; a checkpointed MLP keeps the norm output's shard instead
    mlp_input = (0.0 if norm else esbh / sp) if "mlp" in selective else esbh
    return esbh + mlp_input


def layer_activation_bytes(model: Any, **kwargs: Any) -> float:
    """Total of `layer_activation_terms` (same arguments)."""
    return layer_activation_terms(model, **kwargs).total


# ---------------------------------------------------------------- probe

_LOCK = threading.Lock()  # holders are released from autograd's thread too


@dataclass
class ForwardRecord:
    """What one chunk forward (one microbatch on one model chunk) saved for backward."""

    chunk: int
    microbatch: int
    layer_bytes: dict[str, int] = field(default_factory=dict)  # global layer id -> bytes
    other_bytes: int = 0
    live: int = 0  # saved tensors autograd still holds
    storages: dict[int, tuple[str, Any]] = field(default_factory=dict, repr=False)  # storage id -> (region, storage)

    @property
    def total_bytes(self) -> int:
        return self.other_bytes + sum(self.layer_bytes.values())


class _Held:
    """What autograd stores instead of the tensor: the tensor plus a release notice to the probe."""

    __slots__ = ("tensor", "probe", "record")

    def __init__(self, tensor: torch.Tensor, probe: ActivationProbe, record: ForwardRecord):
        self.tensor, self.probe, self.record = tensor, probe, record
        probe._hold(record)

    def __del__(self) -> None:
        self.probe._release(self.record)


@dataclass(frozen=True)
class ActivationSummary:
    activation_bytes_per_layer: float  # mean over the layers of this rank, per microbatch
    activation_bytes_other: float  # embedding, final norm, head and loss, per microbatch
    activation_bytes_per_microbatch: float  # everything one microbatch saves on this rank (all its chunks)
    peak_microbatches_in_flight: int
    peak_activation_bytes: float  # largest total of saved bytes alive at once, measured at forward ends

    def report_entry(self) -> dict[str, float]:
        """The keys the trainer adds to this rank's entry of memory_report.json."""
        return {
            "activation_bytes_per_layer": self.activation_bytes_per_layer,
            "activation_bytes_other": self.activation_bytes_other,
            "peak_microbatches_in_flight": self.peak_microbatches_in_flight,
        }


class ActivationProbe:
    """Counts bytes saved for backward per layer, per microbatch and outside the layers (see module docstring).

    Use as a context manager around training steps (or attach()/detach()). Only forwards with grad enabled
    are recorded, at most `max_forwards` chunk forwards (None: all); the k-th recorded forward of each chunk
    is microbatch k.
    """

    def __init__(self, chunks: Sequence[nn.Module], max_forwards: Optional[int] = None):
        self.chunks = list(chunks)
        self.max_forwards = max_forwards
        self.records: list[ForwardRecord] = []
        self._handles: list[Any] = []
        self._skip: set[int] = set()
        self._current: Optional[ForwardRecord] = None
        self._region = "other"
        self._hooks_ctx: list[contextlib.AbstractContextManager] = []
        self._forwards: dict[int, int] = {}
        self._alive: dict[int, int] = {}  # microbatch -> records of it still holding tensors
        self.peak_microbatches_in_flight = 0
        self.peak_activation_bytes = 0

    # ------------------------------------------------------------ hooks

    def attach(self) -> ActivationProbe:
        for c, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(lambda _m, _a, c=c: self._begin(c)))
            self._handles.append(chunk.register_forward_hook(lambda _m, _a, _o: self._end(), always_call=True))
            for layer_id, layer in getattr(chunk, "layers", nn.ModuleDict()).items():
                self._handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=layer_id: self._enter_region(i)))
                self._handles.append(
                    layer.register_forward_hook(lambda _m, _a, _o: self._enter_region("other"), always_call=True)
                )
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ActivationProbe:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _enter_region(self, region: str) -> None:
        self._region = region

    def _begin(self, chunk: int) -> None:
        if not torch.is_grad_enabled() or self._current is not None:
            return
        if self.max_forwards is not None and len(self.records) >= self.max_forwards:
            return
        if not self._skip:  # read at the first forward: an optimizer may have moved the parameters into buffers
            for module in self.chunks:
                self._skip.update(t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()])
        k = self._forwards.get(chunk, 0)
        self._forwards[chunk] = k + 1
        self._current = ForwardRecord(chunk, k)
        self._region = "other"
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)
        ctx.__enter__()
        self._hooks_ctx.append(ctx)

    def _end(self) -> None:
        if self._current is None:
            return
        self._hooks_ctx.pop().__exit__(None, None, None)
        record, self._current = self._current, None
        for region, storage in record.storages.values():
            nbytes = storage.nbytes()
            if region == "other":
                record.other_bytes += nbytes
            else:
                record.layer_bytes[region] = record.layer_bytes.get(region, 0) + nbytes
        record.storages = {}  # sizes are taken; keep no references beyond autograd's own
        for layer_id in getattr(self.chunks[record.chunk], "layers", {}):
            record.layer_bytes.setdefault(layer_id, 0)
        self.records.append(record)
        with _LOCK:
            live = sum(r.total_bytes for r in self.records if r.live > 0)
            self.peak_activation_bytes = max(self.peak_activation_bytes, live)

    def _pack(self, tensor: torch.Tensor) -> Any:
        record = self._current
        storage = tensor.untyped_storage()
        key = storage._cdata  # the StorageImpl: unique while we hold it, unlike a data pointer freed and reused
        if record is None or key in self._skip or storage.nbytes() == 0 or isinstance(tensor, nn.Parameter):
            return _Plain(tensor)
        record.storages.setdefault(key, (self._region, storage))
        return _Held(tensor, self, record)

    def _hold(self, record: ForwardRecord) -> None:
        with _LOCK:
            record.live += 1
            if record.live == 1:
                self._alive[record.microbatch] = self._alive.get(record.microbatch, 0) + 1
                self.peak_microbatches_in_flight = max(self.peak_microbatches_in_flight, len(self._alive))

    def _release(self, record: ForwardRecord) -> None:
        with _LOCK:
            record.live -= 1
            if record.live == 0:
                left = self._alive.get(record.microbatch, 1) - 1
                if left:
                    self._alive[record.microbatch] = left
                else:
                    self._alive.pop(record.microbatch, None)

    # ------------------------------------------------------------ results

    def layer_bytes(self) -> dict[str, list[int]]:
        """Bytes per layer id, one value per recorded microbatch."""
        out: dict[str, list[int]] = {}
        for r in self.records:
            for layer_id, nbytes in r.layer_bytes.items():
                out.setdefault(layer_id, []).append(nbytes)
        return out

    def summary(self) -> ActivationSummary:
        if not self.records:
            return ActivationSummary(0.0, 0.0, 0.0, 0, 0.0)
        per_layer = [n for values in self.layer_bytes().values() for n in values]
        microbatches = {r.microbatch for r in self.records}
        total = sum(r.total_bytes for r in self.records)
        return ActivationSummary(
            activation_bytes_per_layer=sum(per_layer) / len(per_layer) if per_layer else 0.0,
            activation_bytes_other=sum(r.other_bytes for r in self.records) / len(microbatches),
            activation_bytes_per_microbatch=total / len(microbatches),
            peak_microbatches_in_flight=self.peak_microbatches_in_flight,
            peak_activation_bytes=float(self.peak_activation_bytes),
        )


# ---------------------------------------------------------------- the trainer's probe

_trainer_probe: Optional[ActivationProbe] = None


def attach_trainer_probe(chunks: Sequence[nn.Module], forwards: int) -> ActivationProbe:
    """Probe the trainer's first `forwards` chunk forwards (its first iteration); read by trainer_report_entry()."""
    global _trainer_probe
    if _trainer_probe is not None:
        _trainer_probe.detach()
    _trainer_probe = ActivationProbe(chunks, max_forwards=forwards).attach()
    return _trainer_probe


def trainer_report_entry() -> dict[str, float]:
    """The activation keys of this rank's memory_report.json entry (empty without a probe); detaches the probe."""
    global _trainer_probe
    if _trainer_probe is None:
        return {}
    probe, _trainer_probe = _trainer_probe, None
    probe.detach()
    return probe.summary().report_entry()


class _Plain:
    """A saved tensor the probe does not count (parameters, buffers, empty tensors)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


__all__ = [
    "ActivationProbe",
    "ActivationSummary",
    "ForwardRecord",
    "attach_trainer_probe",
    "trainer_report_entry",
    "LayerActivationTerms",
    "layer_activation_bytes",
    "layer_activation_terms",
    "uses_flash_attention",
]
