"""Typed run configuration: one dataclass per section, Megatron-LM flag names.

The dataclasses are the single source of truth. The command line is generated
from their fields (``--num-layers`` <- ``ModelConfig.num_layers``; built in
tricorn/config_args.py), a YAML file (``--config``) uses the same names grouped by
section, and command-line flags override the file. ``validate`` checks a config before any process group exists
and returns one human sentence per problem; the entry point
(tricorn.training.main.resolve_config) prints them and exits 2 without a traceback.

No collectives and no device work happen here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from tricorn.config_monitoring import LoggingConfig, ProfilingConfig
from tricorn.fields import (
    AT_LEAST_1,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    Bound,
    flag_field,
    flag_of,
    int_tuple,
    value_error,
)
from tricorn.presets import PRESETS  # noqa: F401 - re-exported: the CLI and tests read the presets here

_f = flag_field  # every section's fields are declared with it


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "Number of transformer blocks.", bound=AT_LEAST_1)
    hidden_size: int = _f(64, "Model width h.", bound=AT_LEAST_1)
    ffn_hidden_size: Optional[int] = _f(
        None,
        "MLP inner width (default 4h, or Llama's 2/3*4h rounded to 256 with --swiglu... see README).",
        bound=AT_LEAST_1,
    )
    num_attention_heads: int = _f(4, "Query heads a.", bound=AT_LEAST_1)
    num_query_groups: Optional[int] = _f(None, "Key/value heads for GQA/MQA (needs --group-query-attention).", bound=AT_LEAST_1)
    group_query_attention: bool = _f(False, "Use --num-query-groups key/value heads.")
    kv_channels: Optional[int] = _f(
        None, "Head dimension of queries, keys and values (default: --hidden-size / --num-attention-heads).", bound=AT_LEAST_1
    )
    qk_layernorm: bool = _f(
        False, "Per-head norm (--normalization) on queries and keys after their projection, before RoPE (Megatron's; Qwen3)."
    )
    seq_length: int = _f(64, "Tokens per sample.", bound=AT_LEAST_1)
    max_position_embeddings: Optional[int] = _f(None, "Longest position (default: --seq-length).", bound=AT_LEAST_1)
    position_embedding_type: str = _f("rope", "Position encoding.", choices=["rope", "learned_absolute"])
    rotary_base: float = _f(10000.0, "RoPE base theta.", bound=POSITIVE)
    rotary_angles_dtype: str = _f(
        "float64",
        "Precision of the RoPE angle tables (float32: transformers' and Megatron's tables).",
        choices=["float64", "float32"],
    )
    use_rope_scaling: bool = _f(False, "Llama 3.1 RoPE frequency scaling (Hugging Face rope_type 'llama3').")
    rope_scaling_factor: float = _f(8.0, "Llama 3.1 RoPE scaling: divide low frequencies by this.", bound=POSITIVE)
    rope_scaling_low_freq_factor: float = _f(1.0, "Llama 3.1 RoPE scaling: wavelengths above original/this are scaled.")
    rope_scaling_high_freq_factor: float = _f(4.0, "Llama 3.1 RoPE scaling: wavelengths below original/this are kept.")
    rope_scaling_original_max_position_embeddings: int = _f(
        8192, "Llama 3.1 RoPE scaling: the pre-training context length.", bound=AT_LEAST_1
    )
    normalization: str = _f("RMSNorm", "Norm layer.", choices=["RMSNorm", "LayerNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the norms.", bound=POSITIVE)
    swiglu: bool = _f(False, "SwiGLU MLP instead of GeLU.")
    disable_bias_linear: bool = _f(False, "No biases in the linear layers.")
    add_qkv_bias: bool = _f(
        False, "Biases on the query, key and value projections (with --disable-bias-linear: only there, as Qwen2)."
    )
    untie_embeddings_and_output_weights: bool = _f(False, "Separate output head instead of reusing the embedding.")
    hidden_dropout: float = _f(0.0, "Dropout on the residual branches.", bound=PROBABILITY)
    attention_dropout: float = _f(0.0, "Dropout on the attention probabilities.", bound=PROBABILITY)
    window_size: Optional[list] = _f(
        None,
        "Sliding-window attention LEFT,RIGHT (Megatron's): query i sees keys i-LEFT..i; RIGHT must be 0, LEFT -1 is "
        "unlimited, LEFT alone means LEFT,0. Hugging Face's sliding_window N is N-1,0.",
        type=int_tuple,
    )
    init_method_std: float = _f(0.02, "Std of the normal initialisation.", bound=POSITIVE)
    vocab_size: Optional[int] = _f(
        None, "Vocabulary size (NullTokenizer / mock data; otherwise from the tokenizer).", bound=AT_LEAST_1
    )
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this times TP.", bound=AT_LEAST_1)
    # Activation recomputation (issue: Recompute).
    recompute_granularity: Optional[str] = _f(None, "Recompute activations in backward.", choices=["full", "selective"])
    recompute_method: Optional[str] = _f(None, "How full recompute picks layers.", choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = _f(
        None, "Layers per recompute group (uniform) or recomputed layers per stage (block).", bound=AT_LEAST_1
    )
    recompute_modules: list = _f(
        ["core_attn"], "Modules recomputed by selective recompute.", nargs="+", choices=["core_attn", "mlp", "norm", "mlp_act"]
    )
    # Activation offload to host memory (Megatron's names; tricorn/parallel/offload.py, docs/memory.md).
    cpu_offloading: bool = _f(
        False, "Offload the activations the first --cpu-offloading-num-layers layers of each model chunk save for backward."
    )
    cpu_offloading_num_layers: int = _f(
        0,
        "Layers of each model chunk whose saved activations go to host memory (> 0 implies --cpu-offloading).",
        bound=NON_NEGATIVE,
    )
    transformer_impl: str = _f("local", "Layer implementation.", choices=["local", "transformer_engine"])
    torch_compile: bool = _f(
        False, "Compile each transformer layer's forward with torch.compile (regional, inductor; docs/compile.md)."
    )
    # Mixture of experts (README "Mixture of experts"); dense MLPs without --num-experts.
    num_experts: Optional[int] = _f(None, "Experts per MoE layer (turns the MLP into a mixture of experts).", bound=AT_LEAST_1)
    moe_router_topk: int = _f(2, "Experts each token is routed to.", bound=AT_LEAST_1)
    moe_ffn_hidden_size: Optional[int] = _f(None, "Inner width of each expert (default: --ffn-hidden-size).", bound=AT_LEAST_1)
    moe_layer_freq: int = _f(1, "Every N-th layer (0, N, 2N, ...) is MoE, the others dense.", bound=AT_LEAST_1)
    moe_shared_expert_intermediate_size: Optional[int] = _f(
        None, "Inner width of a shared expert every token also goes through.", bound=AT_LEAST_1
    )
    moe_router_score_function: str = _f("softmax", "Router scores.", choices=["softmax", "sigmoid"])
    moe_router_enable_expert_bias: bool = _f(False, "Per-expert routing bias for aux-loss-free balancing (sigmoid).")
    moe_router_bias_update_rate: float = _f(1e-3, "Step of the expert bias update per iteration.", bound=NON_NEGATIVE)
    moe_aux_loss_coeff: float = _f(0.0, "Weight of the load-balancing auxiliary loss.", bound=NON_NEGATIVE)
    moe_expert_capacity_factor: Optional[float] = _f(
        None, "Drop token copies beyond ceil(tokens*topk/experts*factor) per expert (default: dropless).", bound=POSITIVE
    )
    moe_token_drop_policy: str = _f("probs", "Which copies an expert over capacity keeps.", choices=["probs", "position"])

    @property
    def attention_window(self) -> Optional[int]:
        """--window-size's left size W (query i sees keys i-W..i), or None for unlimited causal attention."""
        if not self.window_size or self.window_size[0] < 0:
            return None
        return int(self.window_size[0])

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups if self.group_query_attention and self.num_query_groups else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV projection has a bias (every linear's, or --add-qkv-bias alone)."""
        return self.add_qkv_bias or not self.disable_bias_linear

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 4 * self.hidden_size

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts is not None and layer_id % self.moe_layer_freq == 0

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        assert self.vocab_size is not None, "vocab_size must be resolved before the model is built"
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


# The fields that fix a model's weights and math (what a checkpoint's config.yaml pins down). --use-checkpoint-args
# takes them from the checkpoint, a preset sets its own, and a flag or YAML value contradicting either is refused
# (config_args.py). seq_length, dropout, init and recompute are the run's choices, not the model's.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "qk_layernorm",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "disable_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "vocab_size",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
)


CP_COMM_TYPES = ("p2p", "a2a", "allgather")  # --cp-comm-type: tricorn/parallel/context/ has one module each


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "TP: ranks that split each layer's matrices (keep within a node).", bound=AT_LEAST_1)
    pipeline_model_parallel_size: int = _f(1, "PP: pipeline stages.", bound=AT_LEAST_1)
    context_parallel_size: int = _f(1, "CP: ranks that split the sequence of each sample.", bound=AT_LEAST_1)
    cp_comm_type: str = _f(
        "p2p",
        "How CP attention meets the other chunks: a K/V ring, all-to-all over heads, or all-gathered K/V.",
        choices=list(CP_COMM_TYPES),
    )
    sequence_parallel: bool = _f(False, "Shard norms/dropout activations along the sequence over TP.")
    expert_model_parallel_size: int = _f(1, "EP: ranks of DP x CP that split each MoE layer's experts.", bound=AT_LEAST_1)
    expert_tensor_parallel_size: int = _f(
        1,
        "ETP: ranks that split each routed expert's matrices; 1 (replicated over TP) or TP (Megatron's default).",
        bound=AT_LEAST_1,
    )
    num_layers_per_virtual_pipeline_stage: Optional[int] = _f(
        None, "Layers per model chunk (interleaved 1F1B).", bound=AT_LEAST_1
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = _f(
        None, "Model chunks per pipeline rank (interleaved 1F1B).", bound=AT_LEAST_1
    )
    decoder_first_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the first pipeline stage (uneven split).", bound=NON_NEGATIVE
    )
    decoder_last_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the last pipeline stage (uneven split).", bound=NON_NEGATIVE
    )
    pipeline_schedule: str = _f(
        "1f1b",
        "Pipeline schedule (interleaved is picked automatically with virtual stages; zbv and dualpipev run 2 chunks per "
        "rank in a V).",
        choices=["1f1b", "gpipe", "zb-h1", "zbv", "dualpipev"],
    )
    use_distributed_optimizer: bool = _f(False, "Shard optimizer state over DP (ZeRO-1).")
    zero_stage: int = _f(1, "ZeRO stage with --use-distributed-optimizer.", choices=[1, 2, 3])
    overlap_grad_reduce: bool = _f(False, "Overlap the DP gradient reduction with backward.")
    overlap_param_gather: bool = _f(False, "Overlap the distributed optimizer's parameter all-gather with forward.")
    ddp_bucket_size: Optional[int] = _f(
        None, "Elements per DP gradient bucket (default: max(40M, 1M*DP), at most 1/8 of the model chunk).", bound=AT_LEAST_1
    )
    grad_reduce_in_bf16: bool = _f(False, "Reduce gradients in bf16 instead of fp32.")
    optimizer_cpu_offload: bool = _f(False, "Keep master weights and optimizer state on CPU and step there.")
    distributed_timeout_minutes: int = _f(10, "Timeout of collectives; a dead peer becomes an error.", bound=AT_LEAST_1)
    hang_timeout_minutes: Optional[float] = _f(
        None,
        "A rank whose progress stops this long (dead, stopped, or stuck outside collectives) is named and every rank "
        "exits 75 (default: --distributed-timeout-minutes; fractions allowed).",
        bound=POSITIVE,
    )
    # The flight recorder (Megatron's names): each rank's last collectives, dumped when the watchdog names a hang.
    flight_recorder_dump_path: Optional[str] = _f(
        None,
        "Directory for the flight-recorder dumps (one file per rank, written when the watchdog names a hang or NCCL "
        "times out; read them with `tricorn fr-trace DIR`); also turns the recorder's buffer on.",
    )
    flight_recorder_trace_buffer_size: int = _f(
        2000, "Collectives each rank's flight recorder keeps (with --flight-recorder-dump-path).", bound=AT_LEAST_1
    )

    @property
    def zero_stage_in_effect(self) -> int:
        """0 (DDP) to 3. --zero-stage 2/3 implies the distributed optimizer; --zero-stage 1 alone is plain DDP."""
        distributed = self.use_distributed_optimizer or self.zero_stage >= 2
        return self.zero_stage if distributed else 0


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(1, "Samples per microbatch per DP rank.", bound=AT_LEAST_1)
    global_batch_size: Optional[int] = _f(
        None, "Samples per iteration over all DP ranks (default: micro * DP).", bound=AT_LEAST_1
    )
    rampup_batch_size: Optional[list] = _f(
        None, "START INCREMENT SAMPLES: grow the global batch.", nargs=3, type=int, bound=AT_LEAST_1
    )
    train_iters: int = _f(10, "Iterations to train.", bound=AT_LEAST_1)
    train_samples: Optional[int] = _f(
        None, "Samples to train (instead of --train-iters: iterations = samples / --global-batch-size).", bound=AT_LEAST_1
    )
    # The lr and weight-decay schedule: megatron-core's OptimizerParamScheduler, in samples (lr_schedule.py).
    lr: float = _f(1e-4, "Peak learning rate.", bound=NON_NEGATIVE)
    min_lr: float = _f(0.0, "Floor of the decayed learning rate.", bound=NON_NEGATIVE)
    lr_decay_style: str = _f(
        "linear", "Decay after warm-up.", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"]
    )
    lr_wsd_decay_style: str = _f(
        "exponential", "Shape of WSD's final anneal.", choices=["exponential", "linear", "cosine", "minus_sqrt"]
    )
    lr_warmup_iters: int = _f(0, "Linear warm-up iterations.", bound=NON_NEGATIVE)
    lr_warmup_samples: int = _f(0, "Linear warm-up samples (with --train-samples).", bound=NON_NEGATIVE)
    lr_warmup_fraction: Optional[float] = _f(
        None, "Warm-up as a fraction of the decay (instead of --lr-warmup-iters/-samples).", bound=PROBABILITY
    )
    lr_warmup_init: float = _f(0.0, "Learning rate the warm-up starts from (iteration 1's).", bound=NON_NEGATIVE)
    lr_decay_iters: Optional[int] = _f(None, "Iterations of decay (default: --train-iters).", bound=AT_LEAST_1)
    lr_decay_samples: Optional[int] = _f(
        None, "Samples of decay (with --train-samples; default: --train-samples).", bound=AT_LEAST_1
    )
    lr_wsd_decay_iters: Optional[int] = _f(None, "Iterations of WSD's final anneal (the end of the decay).", bound=AT_LEAST_1)
    lr_wsd_decay_samples: Optional[int] = _f(None, "Samples of WSD's final anneal (with --train-samples).", bound=AT_LEAST_1)
    override_opt_param_scheduler: bool = _f(
        False,
        "On resume, take the lr schedule's settings from the flags, not the checkpoint (its count is kept).",
        aliases=["--override-opt_param-scheduler"],
    )
    use_checkpoint_opt_param_scheduler: bool = _f(
        False,
        "On resume, take the lr schedule's settings from the checkpoint, not the flags.",
        aliases=["--use-checkpoint-opt_param-scheduler"],
    )
    weight_decay: float = _f(0.01, "AdamW weight decay (not applied to biases and norms).", bound=NON_NEGATIVE)
    start_weight_decay: Optional[float] = _f(
        None, "Weight decay at the start of a --weight-decay-incr-style schedule.", bound=NON_NEGATIVE
    )
    end_weight_decay: Optional[float] = _f(
        None, "Weight decay at the end of training, of a --weight-decay-incr-style schedule.", bound=NON_NEGATIVE
    )
    weight_decay_incr_style: str = _f(
        "constant", "Weight decay from --start- to --end-weight-decay over training.", choices=["constant", "linear", "cosine"]
    )
    adam_beta1: float = _f(0.9, "Adam beta1.", bound=PROBABILITY)
    adam_beta2: float = _f(0.999, "Adam beta2.", bound=PROBABILITY)
    adam_eps: float = _f(1e-8, "Adam epsilon.", bound=POSITIVE)
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0 disables).", bound=NON_NEGATIVE)
    calculate_per_token_loss: bool = _f(
        False,
        "Normalise the loss by the global batch's valid tokens (default: each microbatch by its own, averaged over "
        "the microbatches, as Megatron).",
    )
    # Precision-aware optimizer (Megatron's flags; docs/distributed-optimizer.md): what the optimizer stores in
    # which dtype. The AdamW update itself is always computed in fp32.
    use_precision_aware_optimizer: bool = _f(
        False, "Store master weights, main grads and Adam moments in the dtypes below (the update is computed in fp32)."
    )
    main_grads_dtype: str = _f("fp32", "Gradient accumulation and reduction dtype (bf16 needs --bf16).", choices=["fp32", "bf16"])
    main_params_dtype: str = _f(
        "fp32",
        "Master weights: fp32 (a copy), or the 16-bit parameters themselves, stochastically rounded: bf16 with --bf16, "
        "fp16 with --fp16.",
        choices=["fp32", "fp16", "bf16"],
    )
    exp_avg_dtype: str = _f(
        "fp32", "Adam's first moment: fp32, bf16 (nearest) or fp16 (per-parameter scale).", choices=["fp32", "fp16", "bf16"]
    )
    exp_avg_sq_dtype: str = _f(
        "fp32", "Adam's second moment: fp32, bf16 (nearest) or fp16 (per-parameter scale).", choices=["fp32", "fp16", "bf16"]
    )
    seed: int = _f(1234, "Seed of initialisation, data order and dropout.", bound=Bound(lo=0, hi=2**32 - 1))
    bf16: bool = _f(False, "bf16 parameters and compute, fp32 master weights.")
    fp16: bool = _f(False, "fp16 parameters and compute with dynamic loss scaling.")
    loss_scale: Optional[float] = _f(None, "Static loss scale for fp16 (default: dynamic).", bound=POSITIVE)
    initial_loss_scale: float = _f(2.0**16, "Initial dynamic loss scale.", bound=POSITIVE)
    min_loss_scale: float = _f(1.0, "Smallest dynamic loss scale.", bound=POSITIVE)
    loss_scale_window: int = _f(1000, "Iterations without overflow before the scale doubles.", bound=AT_LEAST_1)
    hysteresis: int = _f(2, "Overflows tolerated before the scale halves.", bound=AT_LEAST_1)
    fp8_format: Optional[str] = _f(
        None, "FP8 GEMMs: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients).", choices=["e4m3", "hybrid"]
    )
    fp8_recipe: Optional[str] = _f(
        None,
        "FP8 scaling recipe (default: tensorwise with --transformer-impl local, delayed with transformer_engine).",
        choices=["delayed", "tensorwise", "rowwise", "mxfp8"],
    )
    fp8_param_gather: bool = _f(
        False,
        "FP8 primary weights: the FP8 linears' weights are stored in FP8, cast once per step from the fp32 master, and "
        "the distributed optimizer / ZeRO-3 gathers their FP8 bytes.",
    )
    tf32: bool = _f(True, "fp32 runs on CUDA: matmuls and convolutions on TF32 tensor cores.", negate="--no-tf32")
    check_for_nan_in_loss_and_grad: bool = _f(
        True, "Stop when the loss or grad norm is NaN/Inf.", negate="--no-check-for-nan-in-loss-and-grad"
    )
    nan_check_interval: int = _f(
        0, "Also read the NaN check every N iterations (one host sync each; 0: at log lines and saves).", bound=NON_NEGATIVE
    )
    check_for_spiky_loss: bool = _f(
        False, "Skip (on the device) an iteration whose loss or grad norm spikes above --spiky-loss-factor x its running mean."
    )
    spiky_loss_factor: float = _f(
        10.0, "A loss or grad norm above this x its running mean is a spike.", bound=Bound(lo=1, lo_open=True)
    )
    max_skipped_iterations: int = _f(
        10, "Save and stop after this many spiky iterations within 100 iterations.", bound=Bound(lo=1, hi=100)
    )
    exit_signal_handler: bool = _f(False, "Save and exit 0 when --exit-signal arrives.")
    exit_signal: str = _f("SIGTERM", "Signal caught by --exit-signal-handler.", choices=["SIGTERM", "SIGUSR1", "SIGINT"])
    exit_duration_in_mins: Optional[float] = _f(None, "Save and exit after this many minutes.", bound=POSITIVE)
    exit_interval: Optional[int] = _f(None, "Save and exit at an iteration divisible by this.", bound=AT_LEAST_1)


@dataclass
class DataConfig:
    mock_data: bool = _f(False, "Deterministic synthetic tokens (needs --vocab-size).")
    data_path: Optional[list] = _f(None, "Dataset prefix, or WEIGHT PREFIX pairs to blend.", nargs="+")
    train_data_path: Optional[list] = _f(None, "Training datasets (overrides --data-path for train).", nargs="+")
    valid_data_path: Optional[list] = _f(None, "Validation datasets.", nargs="+")
    test_data_path: Optional[list] = _f(None, "Test datasets.", nargs="+")
    split: str = _f("969,30,1", "Train,valid,test proportions of the documents.")
    data_cache_path: Optional[str] = _f(None, "Directory for cached sample indices.")
    tokenizer_type: str = _f(
        "NullTokenizer",
        "Tokenizer (docs/data.md#tokenizers).",
        choices=[
            "NullTokenizer",
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "GPT2BPETokenizer",
            "HuggingFaceTokenizer",
            "TikTokenizer",
            "Llama3Tokenizer",
        ],
    )
    tokenizer_model: Optional[str] = _f(
        None,
        "SentencePiece .model; Hugging Face directory (tokenizer.json); TikTokenizer JSON; Llama 3's tokenizer.model.",
    )
    legacy_tokenizer: bool = _f(False, "Legacy Megatron tokenizers: NullTokenizer eod V (vocab V+1), Llama2Tokenizer BOS.")
    vocab_file: Optional[str] = _f(None, "GPT2BPETokenizer: GPT-2's vocab.json.")
    merge_file: Optional[str] = _f(None, "GPT2BPETokenizer: GPT-2's merges.txt.")
    tokenizer_special_tokens: Optional[list] = _f(
        None, "Special tokens added to a GPT2BPE/HuggingFace tokenizer, or TikTokenizer's special token list.", nargs="+"
    )
    tiktoken_pattern: Optional[str] = _f(None, "TikTokenizer split pattern (default v2).", choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = _f(1000, "TikTokenizer: ids below this are special tokens.", bound=AT_LEAST_1)
    tokenizer_hf_no_include_special_tokens: bool = _f(
        False, "HuggingFaceTokenizer/Llama3Tokenizer: no BOS (the tokenizer's own special tokens) around each document."
    )
    tokenizer_hf_no_use_fast: bool = _f(
        False, "HuggingFaceTokenizer: transformers' slow tokenizer; accepted where it gives the fast one's ids, else refused."
    )
    trust_remote_code: bool = _f(
        False, "Accepted for a Hugging Face directory that needs no code; one that needs code is refused (tricorn runs none)."
    )
    null_tokenizer_eod_id: Optional[int] = _f(
        None, "NullTokenizer end-of-document id (default: vocab size - 1).", bound=NON_NEGATIVE
    )
    null_tokenizer_pad_id: int = _f(-1, "NullTokenizer pad id, left out of the loss (-1: none).", bound=Bound(lo=-1))
    # Documents packed into a sample (megatron-core's GPTDataset; tricorn/data/documents.py, docs/data.md).
    reset_position_ids: bool = _f(False, "Positions restart at 0 after each end-of-document token (RoPE too).")
    reset_attention_mask: bool = _f(False, "No token attends to an earlier document of its sample (fused kernels).")
    eod_mask_loss: bool = _f(False, "A position whose input is the end-of-document token gets no loss.")
    eval_interval: int = _f(1000, "Evaluate on the validation split every N iterations.", bound=AT_LEAST_1)
    eval_iters: int = _f(10, "Validation iterations per evaluation.", bound=NON_NEGATIVE)
    num_workers: int = _f(0, "Data loader worker processes.", bound=NON_NEGATIVE)
    skip_samples: Optional[str] = _f(None, "File of training sample indices (N or A-B) to leave out of the data order.")


@dataclass
class CheckpointConfig:
    save: Optional[str] = _f(None, "Directory to save checkpoints to.")
    load: Optional[str] = _f(None, "Directory to resume from (empty or absent: start fresh).")
    save_interval: Optional[int] = _f(None, "Save every N iterations.", bound=AT_LEAST_1, aliases=["--persistent-save-interval"])
    ckpt_step: Optional[int] = _f(None, "Load this iteration instead of the latest.", bound=NON_NEGATIVE)
    no_load_optim: bool = _f(False, "Do not load optimizer state.")
    no_load_rng: bool = _f(False, "Do not load RNG state.")
    finetune: bool = _f(False, "Load weights only and start at iteration 0.")
    async_save: bool = _f(False, "Write checkpoints in the background.")
    verify_checkpoint: bool = _f(
        True, "Check every checkpoint file against its checksum before loading.", negate="--no-verify-checkpoint"
    )
    keep_last_n_checkpoints: Optional[int] = _f(None, "Delete older checkpoints once a newer one is complete.", bound=AT_LEAST_1)
    use_checkpoint_args: bool = _f(
        False, "Take the model flags from the --load checkpoint's config (a flag that contradicts it is an error)."
    )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "profiling": ProfilingConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    device: Optional[str] = None
    model_preset: Optional[str] = None
    dry_run: bool = False
    world_size: int = 1
    megatron_notice: Optional[str] = None  # the start-up line of a Megatron command line (megatron_flags.py)

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)

    @property
    def virtual_stages(self) -> int:
        p = self.parallel
        if p.num_virtual_stages_per_pipeline_rank:
            return p.num_virtual_stages_per_pipeline_rank
        if p.num_layers_per_virtual_pipeline_stage:
            return self.model.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)
        return 2 if p.pipeline_schedule in ("zbv", "dualpipev") else 1  # the V holds 2 chunks per rank

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size)

    @property
    def param_dtype_name(self) -> str:
        return "bf16" if self.training.bf16 else "fp16" if self.training.fp16 else "fp32"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """Raised with one line per problem; the CLI prints it and exits 2."""


MIN_BUCKET_ELEMENTS = 1_000_000  # below this a bucket's collective is mostly latency


def default_bucket_elements(dp: int, chunk_params: int) -> int:
    """--ddp-bucket-size's default for a model chunk of `chunk_params` trainable parameters: Megatron's
    max(40M, 1M x DP), but at most an eighth of the chunk (and not below MIN_BUCKET_ELEMENTS), so that a chunk of
    several layers is cut into several buckets and --overlap-grad-reduce overlaps all but the last one (which
    holds the embedding, whose gradient comes last) with backward. A chunk over 320M parameters gets Megatron's."""
    return min(max(40_000_000, 1_000_000 * max(dp, 1)), max(MIN_BUCKET_ELEMENTS, -(-chunk_params // 8)))


def field_errors(cfg: Config) -> list[str]:
    """Every field outside its range or type, one sentence each ("--lr must be at least 0, got -0.001").

    The one range check of every value, from the flags, the YAML or code: run by config_from_args before
    any derived value is computed, and again by validate() for configs built in code.
    """
    errors: list[str] = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            problem = value_error(f, getattr(obj, f.name))
            if problem:
                errors.append(f"{flag_of(f)} {problem}")
    return errors


def dump_yaml(cfg: Config) -> str:
    import yaml

    data = {k: v for k, v in cfg.to_dict().items() if k in SECTIONS or k in ("device", "model_preset")}
    return yaml.safe_dump(data, sort_keys=False)
