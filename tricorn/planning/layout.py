"""Layout: everything besides the model's shape that decides a rank's memory and time (a plain record).

A leaf of planning/: the memory estimator (memory.py, activations.py), the step-time model and the planner all
read it; Layout.from_config maps the trainer's config onto it. No arithmetic beyond the bucket size lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tricorn.config import Config, default_bucket_elements
from tricorn.planning.flops import attention_work


@dataclass(frozen=True)
class Layout:
    """Everything besides the model shape that decides per-rank memory (a plain record the planner enumerates)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_comm_type: str = "p2p"  # --cp-comm-type: what CP attention keeps and sends (planning/activations.py, comm.py)
    dp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # None | "selective" | "full"
    recompute_method: Optional[str] = None  # "uniform" | "block"
    recompute_num_layers: Optional[int] = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    zero_stage: int = 0  # 0: no distributed optimizer
    precision: str = "bf16"
    grads_16bit: bool = False
    schedule: str = "1f1b"
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    device: str = "cuda"
    ddp_bucket_elements: Optional[int] = None  # --ddp-bucket-size; None: the default (config.default_bucket_elements)
    ep: int = 1  # expert parallel: ranks of DP x CP that split the MoE experts
    etp: int = 1  # expert tensor parallel: 1 (routed experts replicated over TP) or TP (split like the dense MLP)
    compiled: bool = False  # --torch-compile: the compiled layers keep no RoPE rows (planning/activations.py)
    transformer_impl: str = "local"  # --transformer-impl
    fp8_recipe: Optional[str] = None  # the FP8 recipe in effect (planning/fp8_terms.py); None: no FP8
    fp8_inputs: bool = False  # native FP8, tensorwise: the linears keep FP8 copies of their inputs (activations.py)
    # Documents / window: the (query, key) pairs attention computes over causal attention's (flops.attention_work),
    # what the step-time model scales the attention core by; positions per sample (--reset-position-ids): RoPE's
    # cos / sin rows are kept per sample (activations.py).
    attention_work: float = 1.0
    per_sample_positions: bool = False
    document_bounds: bool = False  # --reset-attention-mask: the attention's host bounds (compiled: saved, activations.py)
    offload_layers: int = 0  # --cpu-offloading-num-layers: each chunk's first N layers save to host (stage_activations.py)
    optimizer_offload: bool = False  # --optimizer-cpu-offload: master weights and Adam moments in host memory
    fp8_param_gather: bool = False  # --fp8-param-gather: the FP8 linears' weights are stored and gathered in FP8
    # The precision-aware optimizer (--use-precision-aware-optimizer): the stored dtypes (planning/memory.py)
    main_params_dtype: str = "fp32"  # master weights: fp32 | fp16 | bf16
    exp_avg_dtype: str = "fp32"  # Adam's first moment: fp32 | fp16 | bf16
    exp_avg_sq_dtype: str = "fp32"  # Adam's second moment: fp32 | fp16 | bf16

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def head_stage(self) -> int:
        """The pipeline rank holding the final norm, the head and the loss: rank 0 on the v placement of zbv and
        dualpipev (it holds virtual stages 0 and 2 pp - 1), else the last."""
        return 0 if self.schedule in ("zbv", "dualpipev") else self.pp - 1

    def bucket_elements(self, chunk_params: float) -> int:
        """DP bucket size for a model chunk of `chunk_params` parameters (what DataParallel picks)."""
        return self.ddp_bucket_elements or default_bucket_elements(self.dp * self.cp, int(chunk_params))

    @classmethod
    def from_config(cls, cfg: Config) -> Layout:
        m, p, t = cfg.model, cfg.parallel, cfg.training
        aware = t.use_precision_aware_optimizer
        return cls(
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            cp=p.context_parallel_size,
            cp_comm_type=p.cp_comm_type,
            dp=cfg.data_parallel_size,
            vpp=cfg.virtual_stages,
            micro_batch=t.micro_batch_size,
            num_microbatches=cfg.num_microbatches,
            sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
            recompute=m.recompute_granularity,
            recompute_method=m.recompute_method,
            recompute_num_layers=m.recompute_num_layers,
            recompute_modules=tuple(m.recompute_modules or ()),
            zero_stage=p.zero_stage_in_effect,  # --zero-stage 2/3 alone is ZeRO-2/3, as the trainer runs it
            precision=cfg.param_dtype_name,
            grads_16bit=(p.grad_reduce_in_bf16 or (aware and t.main_grads_dtype == "bf16")) and cfg.param_dtype_name != "fp32",
            schedule=p.pipeline_schedule,
            first_stage_layers=p.decoder_first_pipeline_num_layers,
            last_stage_layers=p.decoder_last_pipeline_num_layers,
            device=cfg.device or "cuda",
            ddp_bucket_elements=p.ddp_bucket_size,
            ep=p.expert_model_parallel_size,
            etp=p.expert_tensor_parallel_size,
            compiled=m.torch_compile,
            transformer_impl=m.transformer_impl,
            fp8_recipe=(t.fp8_recipe or ("delayed" if m.transformer_impl == "transformer_engine" else "tensorwise"))
            if t.fp8_format
            else None,
            fp8_inputs=bool(t.fp8_format) and m.transformer_impl == "local" and (t.fp8_recipe or "tensorwise") == "tensorwise",
            attention_work=attention_work(m.seq_length, m.attention_window),  # the documents are not known here
            per_sample_positions=cfg.data.reset_position_ids,
            document_bounds=cfg.data.reset_attention_mask,
            offload_layers=m.cpu_offloading_num_layers,
            optimizer_offload=p.optimizer_cpu_offload,
            fp8_param_gather=bool(t.fp8_format) and t.fp8_param_gather and m.transformer_impl == "local",
            main_params_dtype=t.main_params_dtype if aware else "fp32",
            exp_avg_dtype=t.exp_avg_dtype if aware else "fp32",
            exp_avg_sq_dtype=t.exp_avg_sq_dtype if aware else "fp32",
        )
