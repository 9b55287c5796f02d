"""Every check a config passes before any process group exists (DESIGN principle 8).

`validate(cfg)` returns one sentence per problem, the layout problems first. It sits above
config.py (the leaf every module reads) and beside the features whose own validators it calls
(pipeline split, ramp-up, recompute, Transformer Engine), so that config.py imports nothing
from tricorn.parallel or tricorn.training. No collectives, no memory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from tricorn.config import Config, field_errors
from tricorn.data.skip_samples import skip_samples_errors
from tricorn.lr_schedule import schedule_errors
from tricorn.model.masking import validate_attention_mask
from tricorn.parallel.batch_schedule import validate_rampup
from tricorn.parallel.compile import validate_compile
from tricorn.parallel.fp8 import validate_fp8
from tricorn.parallel.fp8_params import validate_fp8_param_gather
from tricorn.parallel.offload import validate_offload
from tricorn.parallel.pipeline.stages import validate_pipeline
from tricorn.parallel.precision import validate_precision
from tricorn.parallel.recompute import validate_recompute
from tricorn.parallel.te import validate_te
from tricorn.profiling import snapshot_path, validate_profiling

# What each tokenizer type reads, for the one-line error when it is missing.
_TOKENIZER_INPUT = {
    "HuggingFaceTokenizer": "--tokenizer-model DIR (a Hugging Face directory with tokenizer.json)",
    "TikTokenizer": "--tokenizer-model FILE.json (a TikTokenizer vocabulary such as Tekken's)",
    "Llama3Tokenizer": "--tokenizer-model tokenizer.model (Llama 3's original tiktoken file)",
}


def tokenizer_flag_errors(d) -> list[str]:
    """The tokenizer type has the files it reads (the files themselves are checked when the tokenizer is built)."""
    if d.tokenizer_type == "NullTokenizer":
        return []
    if d.tokenizer_type == "GPT2BPETokenizer":
        missing = [f for f, v in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)) if not v]
        return (
            [f"--tokenizer-type GPT2BPETokenizer needs {' and '.join(missing)} (GPT-2's vocab.json, merges.txt)"]
            if missing
            else []
        )
    if not d.tokenizer_model:
        return [
            f"--tokenizer-type {d.tokenizer_type} needs {_TOKENIZER_INPUT.get(d.tokenizer_type, '--tokenizer-model FILE.model')}"
        ]
    return []


def validate(cfg: Config) -> list[str]:
    """Every problem with the config, one sentence each, before any process group exists."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.training, cfg.data
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    errs = field_errors(cfg)  # types and ranges first: the checks below divide by these values
    if errs:
        return errs
    # The split of the model over TP comes first: it is what a user asking for a layout most needs to see.
    if m.num_attention_heads % tp != 0:
        errs.append(f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads != 0:
        errs.append(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}; "
            "give the head dimension with --kv-channels"
        )
    if m.group_query_attention and not m.num_query_groups:
        errs.append("--group-query-attention needs --num-query-groups")
    if m.num_query_groups and not m.group_query_attention:
        errs.append("--num-query-groups needs --group-query-attention")
    if m.kv_heads and m.num_attention_heads % m.kv_heads != 0:
        errs.append(f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.kv_heads}")
    if m.group_query_attention and m.num_query_groups and m.num_query_groups % tp != 0:
        errs.append(f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    if m.ffn_size % tp != 0:
        errs.append(f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}")
    if m.position_embedding_type == "rope" and m.head_dim % 2 != 0:
        what = "--kv-channels" if m.kv_channels else "hidden/heads"
        errs.append(f"RoPE needs an even head dimension, got {what} = {m.head_dim}")
    if m.use_rope_scaling and m.position_embedding_type != "rope":
        errs.append("--use-rope-scaling needs --position-embedding-type rope")
    if m.use_rope_scaling and not m.rope_scaling_high_freq_factor > m.rope_scaling_low_freq_factor > 0:
        errs.append(
            f"--rope-scaling-high-freq-factor {m.rope_scaling_high_freq_factor} must exceed "
            f"--rope-scaling-low-freq-factor {m.rope_scaling_low_freq_factor}, and both must be positive"
        )
    if m.seq_length > m.max_positions:
        errs.append(f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_positions}")
    if p.sequence_parallel and m.seq_length % (tp * cp) != 0:
        errs.append(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by TP x CP = {tp * cp}")
    if cp > 1 and m.seq_length % (2 * cp) != 0:
        errs.append(
            f"--context-parallel-size {cp} needs --seq-length {m.seq_length} divisible by 2 x CP = {2 * cp} (each rank keeps "
            f"2 of 2 x CP chunks); use --seq-length {-(-m.seq_length // (2 * cp)) * 2 * cp}"
        )
    if cp > 1 and p.cp_comm_type == "a2a" and m.num_attention_heads % tp == 0 and (m.num_attention_heads // tp) % cp != 0:
        errs.append(
            f"--cp-comm-type a2a needs the query heads per TP rank ({m.num_attention_heads} / TP {tp} = "
            f"{m.num_attention_heads // tp}) divisible by --context-parallel-size {cp}; use --cp-comm-type p2p or allgather"
        )
    world_ok = cfg.world_size % (tp * pp * cp) == 0
    if not world_ok:
        errs.append(
            f"world size {cfg.world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}; "
            f"launch a multiple of {tp * pp * cp} processes or change the parallel sizes"
        )
    dp = cfg.data_parallel_size
    if world_ok and t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp) != 0:
        errs.append(
            f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size x DP = "
            f"{t.micro_batch_size} x {dp} = {t.micro_batch_size * dp}"
        )
    if p.overlap_param_gather and not (p.use_distributed_optimizer or p.zero_stage > 1):
        errs.append(
            "--overlap-param-gather needs --use-distributed-optimizer (plain DDP all-reduces gradients; "
            "there is no parameter all-gather to overlap)"
        )
    if t.min_lr > t.lr:
        errs.append(f"--min-lr {t.min_lr} is above --lr {t.lr}; the decay would raise the learning rate")
    errs += schedule_errors(t)
    if t.bf16 and t.fp16:
        errs.append("--bf16 and --fp16 are exclusive; pick one")
    if cfg.device not in ("cpu", "cuda"):
        errs.append(f"--device must be cpu or cuda, got '{cfg.device}'")
    if not d.mock_data and not (d.data_path or d.train_data_path):
        errs.append("no training data: pass --data-path PREFIX (see `tricorn preprocess`) or --mock-data")
    if d.mock_data and m.vocab_size is None:
        errs.append("--mock-data needs --vocab-size")
    if not d.mock_data:
        errs += tokenizer_flag_errors(d)
    if p.hang_timeout_minutes is not None and p.hang_timeout_minutes > p.distributed_timeout_minutes:
        errs.append(
            f"--hang-timeout-minutes {p.hang_timeout_minutes:g} exceeds --distributed-timeout-minutes "
            f"{p.distributed_timeout_minutes}: the collectives would time out before the watchdog names the stuck rank; "
            "lower it or raise --distributed-timeout-minutes"
        )
    errs += validate_te(cfg)  # device, installed version in the pinned range, recipe, GPU for mxfp8
    if t.fp8_format and not (t.bf16 or t.fp16):
        errs.append("--fp8-format needs --bf16 (FP8 GEMMs keep bf16 weights and activations around them)")
    if t.fp8_recipe and not t.fp8_format:
        errs.append(f"--fp8-recipe {t.fp8_recipe} needs --fp8-format e4m3|hybrid (it chooses how FP8 GEMMs are scaled)")
    errs += validate_precision(cfg)  # the precision-aware optimizer's dtypes
    errs += validate_fp8_param_gather(cfg)  # FP8 primary weights
    if not errs:  # each feature validates its own flags once the basic shape is sound
        errs += (
            validate_pipeline(cfg)
            + validate_rampup(cfg)
            + validate_recompute(cfg)
            + validate_offload(cfg)
            + validate_moe(cfg)
            + validate_compile(cfg)
            + validate_fp8(cfg)
            + validate_attention_mask(cfg)
            + skip_samples_errors(d.skip_samples, t.train_iters * t.global_batch_size if t.global_batch_size else 0)
            + validate_profiling(cfg)
        )
    return errs


def validate_moe(cfg: Config) -> list[str]:
    """The mixture-of-experts flags (README "Mixture of experts"), one sentence per problem."""
    m, p = cfg.model, cfg.parallel
    moe_flags = m.moe_expert_capacity_factor or m.moe_aux_loss_coeff or m.moe_shared_expert_intermediate_size
    ep = p.expert_model_parallel_size
    if m.num_experts is None:
        if p.expert_tensor_parallel_size > 1:
            return ["--expert-tensor-parallel-size needs --num-experts (it splits the routed experts)"]
        needs = moe_flags or m.moe_router_enable_expert_bias or ep > 1
        return ["--moe-* flags and --expert-model-parallel-size need --num-experts"] if needs else []
    errs = []
    etp, tp = p.expert_tensor_parallel_size, p.tensor_model_parallel_size
    if etp not in (1, tp):
        errs.append(
            f"--expert-tensor-parallel-size {etp} is not supported: use 1 (experts replicated over TP) or "
            f"{tp}, the --tensor-model-parallel-size (each expert split over TP)"
        )
    elif etp > 1 and m.moe_ffn_size % etp:
        errs.append(f"--moe-ffn-hidden-size {m.moe_ffn_size} is not divisible by --expert-tensor-parallel-size {etp}")
    if m.num_experts % ep != 0:
        errs.append(f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    dp_cp = cfg.data_parallel_size * p.context_parallel_size
    if dp_cp % ep != 0:
        errs.append(f"--expert-model-parallel-size {ep} must divide DP x CP = {dp_cp} (experts split over data-parallel ranks)")
    if ep > 1 and p.zero_stage_in_effect > 1:
        errs.append(f"--expert-model-parallel-size > 1 supports --zero-stage 1 only, got {p.zero_stage}")
    if m.moe_router_topk > m.num_experts:
        errs.append(f"--moe-router-topk {m.moe_router_topk} exceeds --num-experts {m.num_experts}")
    if not m.disable_bias_linear:
        errs.append("--num-experts needs --disable-bias-linear (experts have no biases, as in Mixtral and DeepSeek)")
    statistics = m.moe_aux_loss_coeff or m.moe_expert_capacity_factor or m.moe_router_enable_expert_bias
    if p.context_parallel_size > 1 and statistics:
        errs.append(
            "--context-parallel-size > 1 with the aux loss, token dropping or the expert bias is not supported yet "
            "(the router statistics would cover one sequence chunk)"
        )
    return errs


# ---------------------------------------------------------------- output paths, checked before launch


def output_path_errors(cfg: Config) -> list[str]:
    """Every output path that training would fail to create or write, found before anything is created.

    Directories (--save, --tensorboard-dir, --log-dir, --data-cache-path, --flight-recorder-dump-path,
    --wandb-save-dir) must be directories or creatable ones; --metrics-file and, with --record-memory-history,
    --memory-snapshot-path (rank 0's name) must be files or creatable; --load, when it exists, must be a directory. A
    probe file is created and removed in the nearest existing directory, so permissions, read-only
    mounts and pseudo file systems (/proc) are all caught the same way; nothing else is written.
    """
    c, lg = cfg.checkpoint, cfg.logging
    dirs = [("--save", c.save), ("--tensorboard-dir", lg.tensorboard_dir), ("--log-dir", lg.log_dir)]
    dirs.append(("--data-cache-path", cfg.data.data_cache_path))
    dirs += [("--flight-recorder-dump-path", cfg.parallel.flight_recorder_dump_path), ("--wandb-save-dir", lg.wandb_save_dir)]
    errs = [e for flag, path in dirs if path for e in [_writable_error(flag, path, want_dir=True)] if e]
    files = [("--metrics-file", lg.metrics_file)]
    if cfg.profiling.record_memory_history:  # the snapshot is written on out-of-memory too: its place must work now
        files.append(("--memory-snapshot-path", snapshot_path(cfg.profiling.memory_snapshot_path, 0, cfg.world_size)))
    errs += [e for flag, path in files if path for e in [_writable_error(flag, path, want_dir=False)] if e]
    if c.load and os.path.exists(c.load) and not os.path.isdir(c.load):
        errs.append(f"--load {c.load} is a file; it needs the checkpoint directory (the one --save wrote)")
    return errs


def _writable_error(flag: str, path: str, want_dir: bool) -> Optional[str]:
    target = Path(path)
    if target.exists():
        if want_dir and not target.is_dir():
            return f"{flag} {path} is a file but must be a directory; remove it or pick another path"
        if not want_dir and target.is_dir():
            return f"{flag} {path} is a directory but must be a file; name a file inside it"
        if not want_dir:
            return _access_error(flag, path, os.access(target, os.W_OK), "the file is not writable")
        return _probe_error(flag, path, target)
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{flag} {path} cannot be created: {parent} is a file, not a directory"
    return _probe_error(flag, path, parent)


def _probe_error(flag: str, path: str, directory: Path) -> Optional[str]:
    try:
        fd, probe = tempfile.mkstemp(prefix=".tricorn-probe-", dir=directory)
    except OSError as e:
        return _access_error(flag, path, False, f"cannot write in {directory} ({e.strerror})")
    os.close(fd)
    os.unlink(probe)
    return None


def _access_error(flag: str, path: str, ok: bool, why: str) -> Optional[str]:
    return None if ok else f"{flag} {path}: {why}; pick a writable location"
