"""What each Megatron-LM flag that tricorn's parser does not define does here: a no-op, or refused.

Data only (tricorn/megatron_flags.py applies it). Keys are the dests of Megatron-LM's argument parser at
core_v0.19.0 (tricorn/megatron_args.json); a flag tricorn's own parser defines is implemented, whatever is
written here (tests/test_megatron_flags.py then asks for its line to go).

- NO_OPS: reason -> dests. The flag changes how Megatron runs (kernels, fusions, overlap, memory, process
  groups, checkpoint I/O strategy) or what it logs and profiles, or it belongs to another model or script
  (BERT, T5, vision, retrieval, RL, inference); tricorn's run is the same with or without it.
- REFUSED: reason -> dests. The flag changes the math (model, loss, data, optimizer, schedule, precision) or
  asks for something tricorn does not do. Refused unless its value is the one tricorn does anyway: Megatron's
  default, or what FINE says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union


def _names(text: str) -> tuple[str, ...]:
    """Dests written as words (the tables are long: one per line would be ~500 lines)."""
    return tuple(text.split())


# ---------------------------------------------------------------- why a flag is a no-op

PERF = "a kernel, fusion, overlap, memory or communication choice of Megatron's; the math is the same"
LOGGING = "logging, profiling or monitoring that tricorn does its own way (docs/monitoring.md)"
OTHER_SCRIPT = "read by Megatron's other models or scripts (BERT, T5, vision, retrieval, RL, inference), not GPT pretraining"
PROCESS = "process-group and launcher set-up; tricorn builds its own (docs/launching.md)"
CKPT_IO = "how Megatron writes or reads its checkpoints; tricorn's are sharded DCP that reshard on load (docs/checkpoints.md)"
RESTART = (
    "Megatron's fault-tolerance services; tricorn's are --exit-signal-handler and --hang-timeout-minutes (docs/reliability.md)"
)
ONLY_WITH = "only read together with a flag tricorn refuses (the optimizer, architecture or feature it belongs to)"
DEPRECATED_NOOP = "deprecated in Megatron, where it does nothing either"

NO_OPS: dict[str, tuple[str, ...]] = {
    PERF: _names(
        """
        tensor_parallel_num_weight_shards pipeline_model_parallel_comm_backend
        hierarchical_context_parallel_sizes expert_tensor_parallel_num_weight_shards use_cpu_initialization
        deterministic_mode tp_comm_overlap tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag
        tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs
        cross_entropy_loss_fusion cross_entropy_fusion_impl tp_comm_bootstrap_backend
        overlap_moe_expert_parallel_comm delay_wgrad_compute overlap_dispatch_backward_with_experts_wgrad
        ep_overlap_early_attn_memory_release use_ring_exchange_p2p defer_embedding_wgrad_compute
        wgrad_deferral_limit overlap_p2p_comm_warmup_flush microbatch_group_size_per_vp_stage
        cpu_offloading_retain_pinned_cpu_buffers
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split attention_backend
        flash_attention_version init_model_with_meta_device use_fused_weighted_squared_relu
        fused_residual_rmsnorm use_transformer_engine_op_fuser distribute_saved_activations
        high_priority_a2a_comm_stream moe_shared_expert_overlap use_grouped_gemm_for_shared_expert
        moe_enable_routing_replay use_grouped_gemm_for_dense_mlp moe_grouped_gemm moe_single_grouped_weight
        moe_single_grouped_bias moe_token_dispatcher_type moe_enable_deepep moe_flex_dispatcher_backend
        moe_permute_fusion_into_hybridep moe_hybridep_pad_uneven_dispatch_inputs
        moe_pad_expert_input_to_capacity moe_layer_recompute moe_permute_fusion moe_router_fusion
        moe_flex_dispatcher_num_sms moe_deepep_num_sms moe_hybridep_num_sms moe_hybridep_num_blocks_permute
        moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing moe_ncclep_static_shape
        moe_ncclep_zero_copy enable_cuda_graph cuda_graph_warmup_steps external_cuda_graph cuda_graph_impl
        clone_scatter_output_in_embedding batch_invariant_mode use_te_activation_func
        mlp_chunks_for_training fine_grained_activation_offloading offload_modules min_offloaded_tensor_size
        delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks activation_offload_fraction
        moe_paged_stash moe_paged_stash_page_size moe_paged_stash_buffer_size_factor_cuda
        moe_paged_stash_buffer_size_factor_cpu fine_grained_offloading_max_inflight_offloads
        empty_unused_memory_level tp_comm_overlap_cfg masked_softmax_fusion bias_gelu_fusion
        bias_swiglu_fusion bias_dropout_fusion apply_rope_fusion use_flash_attn optimizer_cuda_graph
        use_torch_optimizer_for_cpu_offload overlap_cpu_optimizer_d2h_h2d pin_cpu_grads pin_cpu_params
        no_persist_layer_norm gradient_accumulation_fusion manual_gc manual_gc_interval manual_gc_eval
        te_rng_tracker attention_softmax_in_fp32 accumulate_allreduce_grads_in_fp32
        reuse_grad_buf_for_mxfp8_param_ag align_grad_reduce overlap_p2p_comm ddp_num_buckets
        ddp_pad_buckets_for_high_nccl_busbw ddp_reduce_scatter_with_fp32_accumulation
        ddp_param_name_patterns_for_fp32_local_accumulation ddp_average_in_collective
        overlap_param_gather_with_optimizer_step align_param_gather use_layer_wise_param_layout nccl_ub
        disable_symmetric_registration create_all_gather_group gradient_reduce_div_fusion
        suggested_communication_unit_size keep_fp8_transpose_cache num_distributed_optimizer_instances
        disable_jit_fuser pipeline_model_parallel_layout mla_down_proj_fusion cuda_graph_scope_deprecated
        cuda_graph_modules dataloader_fast_cache_load dataloader_defer_npy_index_mmap mmap_bin_files
        num_dataset_builder_threads create_attention_mask_in_dataloader deprecated_use_mcore_models
        use_tp_pp_dp_mapping
        """
    ),
    LOGGING: _names(
        """
        pytorch_profiler_collect_chakra nvtx_ranges log_throughput log_progress
        timing_log_option tensorboard_log_interval tensorboard_queue_size log_timers_to_tensorboard
        log_loss_scale_to_tensorboard log_validation_ppl_to_tensorboard log_memory_to_tensorboard
        log_memory_interval log_device_memory_used log_num_zeros_in_grad log_max_attention_logit
        barrier_with_L1_time log_world_size_to_tensorboard logging_level log_energy moe_routing_trace_path moe_routing_trace_max_training_iters
        moe_routing_trace_capture_logits moe_routing_trace_capture_hidden_states
        moe_routing_trace_dump_weights moe_per_layer_logging config_logger_dir log_straggler
        straggler_ctrlr_port straggler_minmax_count disable_straggler_on_startup
        run_workload_inspector_server enable_one_logger one_logger_project one_logger_run_name
        one_logger_async app_tag_run_name app_tag_run_version check_weight_hash_across_dp_replicas_interval
        gpu_sniff_test_interval train_sync_interval dump_param_to_param_group_map flight_recorder_dump_on_timeout
        flight_recorder_include_stack_trace flight_recorder_include_only_active
        flight_recorder_extra_dump_on_exec check_for_large_grads result_rejected_tracker_filename
        """
    ),
    OTHER_SCRIPT: _names(
        """
        relative_attention_num_buckets relative_attention_max_distance onnx_safe bert_binary_head
        sample_rate mask_prob short_seq_prob chat_template sft_tokenizer_prompt_format flash_decode
        symmetric_ar_type nccl_all_reduce_for_prefill inference_fuse_tp_communication
        inference_disable_triton_nvls_kernels inference_grouped_gemm_backend
        inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type
        inference_cuda_graph_scope mlp_chunks_for_prefill moe_pad_experts_for_cuda_graph_inference
        inference_rng_tracker cache_mla_latents mamba_inference_conv_states_dtype
        mamba_inference_ssm_states_dtype
        """
    )
    + _names(
        # BERT / retrieval
        """
        ict_head_size biencoder_projection_dim biencoder_shared_query_context_model ict_load bert_load
        titles_data_path query_in_block_prob use_one_sent_docs evidence_data_path
        retriever_report_topk_accuracies retriever_score_scaling block_data_path embedding_path
        indexer_batch_size indexer_log_interval output_bert_embeddings bert_embedder_type
        """
    )
    + _names(
        # vision
        """
        num_classes img_h img_w num_channels patch_dim classes_fraction data_per_class_fraction
        data_sharding head_lr_mult vision_pretraining vision_pretraining_type vision_backbone_type
        swin_backbone_type mask_type mask_factor iter_per_epoch dino_local_img_size dino_local_crops_number
        dino_head_hidden_size dino_bottleneck_size dino_freeze_last_layer dino_norm_last_layer
        dino_warmup_teacher_temp dino_teacher_temp dino_warmup_teacher_temp_epochs
        """
    )
    + _names(
        # inference
        """
        inference_batch_times_seqlen_threshold max_tokens_to_oom use_legacy_static_engine
        inference_max_requests inference_max_seq_length inference_dynamic_batching
        inference_dynamic_batching_buffer_size_gb inference_dynamic_batching_paused_buffer_size_gb
        inference_dynamic_batching_mamba_memory_ratio inference_dynamic_batching_block_size
        inference_dynamic_batching_max_requests inference_dynamic_batching_max_tokens
        inference_dynamic_batching_num_cuda_graphs inference_dynamic_batching_track_paused_request_events
        inference_dynamic_batching_track_generated_token_events decode_only_cuda_graphs
        inference_cuda_graph_all_prefills inference_cuda_graph_max_tokens
        inference_dynamic_batching_unified_memory_level enable_chunked_prefill num_speculative_tokens
        inference_dynamic_batching_enable_prefix_caching
        inference_dynamic_batching_prefix_caching_eviction_policy
        inference_dynamic_batching_prefix_caching_coordinator_policy
        inference_dynamic_batching_prefix_caching_routing_alpha
        inference_dynamic_batching_prefix_caching_mamba_gb
        inference_dynamic_batching_cuda_graph_mixed_prefill_count
        inference_dynamic_batching_cuda_graph_sizing_distribution
        inference_dynamic_batching_sampling_backend offset_sampling_seed_by_dp_rank
        inference_dynamic_batching_async_sched_mode inference_dynamic_batching_logprobs_mode
        inference_logging_step_interval inference_text_gen_server_logging inference_wandb_logging
        inference_coordinator_port inference_use_synchronous_zmq_collectives inference_disable_ep_consensus
        inference_shards
        """
    )
    + _names(
        # RL (the training loop reads only --perform-rl-step, refused below)
        """
        rl_prompts_per_eval grpo_prompts_per_step grpo_group_size rl_generation_lag
        rl_submission_granularity rl_consumption_granularity grpo_iterations grpo_clamp_eps_lower
        grpo_clamp_eps_upper grpo_kl_beta grpo_entropy_term_weight grpo_filter_groups_with_same_reward
        langrl_env_config rl_default_temperature rl_default_top_p rl_default_top_k
        rl_offload_optimizer_during_inference rl_kv_cache_management_mode rl_persist_cuda_graphs
        rl_partial_rollouts rl_inference_logprobs_is_correction rl_importance_sampling_truncation_coef
        rl_use_sequence_packing rl_sequence_packing_max_sequences_per_bin rl_sequence_packing_algo
        rl_training_cuda_graphs rl_inference_tensor_model_parallel_size
        rl_inference_pipeline_model_parallel_size rl_inference_expert_model_parallel_size
        rl_inference_expert_tensor_model_parallel_size rl_inference_model_unified_memory_level
        rl_offload_inference_model_weights_when_idle refit_method rl_verify_model_weights_swap
        rl_skip_bos_token rl_profile rl_profile_dir rl_inference_parsers
        """
    ),
    PROCESS: _names(
        """
        local_rank lazy_mpu_init nccl_communicator_config_path use_gloo_process_groups use_sharp
        sharp_enabled_group high_priority_stream_groups distributed_timeout_seconds_after_init
        exit_signal_handler_for_dataloader exit_signal_handler_for_training enable_experimental
        disable_msc_deprecated
        """
    ),
    CKPT_IO: _names(
        """
        ckpt_fully_parallel_save async_strategy use_persistent_ckpt_worker async_ckpt_cpu_priority
        async_ckpt_io_priority async_ckpt_use_cpu_shm ckpt_fully_parallel_load
        ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_save_process_group
        ckpt_fully_parallel_load_process_group ckpt_assume_constant_structure
        ckpt_load_validate_sharding_integrity strict_fsdp_dtensor_load dist_ckpt_strictness
        dist_ckpt_save_pre_mcore_014 dist_ckpt_optim_fully_reshardable
        distrib_optim_fully_reshardable_mem_efficient replication replication_jump replication_factor
        verify_integrity stream_ckpt_dequant no_save_optim no_save_rng dist_ckpt_workers
        auto_detect_ckpt_format use_tokenizer_model_from_checkpoint_args load_main_params_from_ckpt
        """
    ),
    RESTART: _names(
        """
        adlr_autoresume adlr_autoresume_interval inprocess_restart inprocess_max_iterations
        inprocess_monitor_thread_interval inprocess_monitor_process_interval
        inprocess_progress_watchdog_interval inprocess_heartbeat_interval inprocess_soft_timeout
        inprocess_hard_timeout inprocess_heartbeat_timeout inprocess_barrier_timeout
        inprocess_completion_timeout inprocess_last_call_wait inprocess_termination_grace_time
        inprocess_granularity inprocess_active_world_size inprocess_empty_cuda_cache enable_ft_package
        calc_ft_timeouts ft_num_warmup_iters
        """
    ),
    ONLY_WITH: _names(
        # --optimizer sgd / muon / lion
        """
        sgd_momentum muon_momentum muon_split_qkv muon_nesterov muon_scale_mode muon_fp32_matmul_prec
        muon_coefficient_type muon_num_ns_steps muon_tp_mode muon_extra_scale_factor muon_scalar_optimizer
        lion_beta1 lion_beta2
        """
    )
    + _names(
        # --multi-latent-attention, --experimental-attention-variant, hybrid Mamba, MTP, muP
        """
        q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim rotary_scaling_factor mscale
        mscale_all_dim dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq
        dsa_indexer_skip_topk_offset dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss dsa_kernel_backend
        dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu
        dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 linear_conv_kernel_dim linear_key_head_dim
        linear_value_head_dim linear_num_key_heads linear_num_value_heads mamba_state_dim mamba_head_dim
        mamba_num_groups mamba_num_heads use_mamba_mem_eff_path mamba_training_ssm_states_dtype
        mtp_standalone mtp_loss_scaling_factor mtp_use_repeated_layer mtp_detach_heads
        mtp_hybrid_override_pattern mup_width_mult mup_base_hidden_size mup_embedding_mult mup_output_mult
        mup_base_head_dim mup_attn_scale_power qk_clip_alpha qk_clip_threshold
        """
    )
    + _names(
        # --rope-type yarn, --fim-data, --logits-load-dir / --logits-save-dir, --moe-use-upcycling, FP4, Megatron-FSDP, --use-kitchen-attention
        """
        yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow
        yarn_correction_range_round_to_int fim_rate fim_spm_rate fim_split_sample fim_fragment_rate
        fim_no_prefix fim_prefix_token fim_middle_token fim_suffix_token fim_pad_token fim_eod_token
        logits_save_top_k logits_save_top_p logits_save_top_p_min_k logits_save_dtype
        logits_load_decode_threads logits_load_prefetch_factor logits_load_msc_prefetch_depth
        logits_load_kd_loss_alpha logits_load_ignore_errors moe_upcycling_granularity fp4_recipe
        fp4_quantizer_factory data_parallel_sharding_strategy outer_dp_sharding_strategy fsdp_double_buffer
        fsdp_manual_registration enable_full_sharding_in_hsdp torch_fsdp2_reshard_after_forward
        megatron_fsdp_main_params_dtype megatron_fsdp_main_grads_dtype megatron_fsdp_grad_comm_dtype
        megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_max_pool_double_buffer
        fsdp_db_use_persist_buf_on_alloc_fail kitchen_attention_backend num_layers_at_start_in_bf16
        num_layers_at_end_in_bf16
        """
    ),
    DEPRECATED_NOOP: ("use_dist_ckpt_deprecated", "dist_ckpt_format_deprecated", "ckpt_fully_parallel_save_deprecated"),
}

# ---------------------------------------------------------------- why a flag is refused

ARCH = "changes the model: an architecture tricorn does not implement"
MOE = "changes the mixture of experts: a routing or expert variant tricorn does not implement (docs/moe.md)"
INIT = "changes the initialisation"
LOSS = "changes the loss or which tokens it counts"
DATA = "changes the training samples or their order"
OPTIMIZER = "changes the optimizer or its schedule"
PRECISION = "changes the numerics: a precision or quantisation tricorn does not implement (docs/fp8.md)"
PARALLEL = "a parallel layout tricorn does not implement; its equivalent is named in docs/megatron-flags.md"
TOKENIZER = "a tokenizer setting tricorn does not implement (docs/data.md#tokenizers)"
CKPT = "a checkpoint behaviour tricorn does not have (docs/checkpoints.md)"
EVAL = "an evaluation behaviour tricorn does not have (it evaluates --eval-iters batches every --eval-interval)"
FEATURE = "a training mode tricorn does not have"
DEPRECATED = "deprecated in Megatron; use its replacement (docs/megatron-flags.md)"

REFUSED: dict[str, tuple[str, ...]] = {
    ARCH: _names(
        """
        fp32_residual_connection apply_residual_connection_post_layernorm
        layernorm_zero_centered_gamma glu_linear_offset activation_func_clamp_value
        rotary_interleaved qk_l2_norm qk_clip attention_output_gate softmax_type
        multi_latent_attention experimental_attention_variant use_mup apply_query_key_layer_scaling
        mtp_num_layers mrope_section is_hybrid_model encoder_num_layers decoder_num_layers
        window_attn_skip_freq rotary_percent rotary_seq_len_interpolation_factor no_rope_freq
        add_position_embedding openai_gelu squared_relu quick_geglu rope_type
        heterogeneous_layers_config_path heterogeneous_layers_config_encoded_json linear_attention_freq spec
        hybrid_layer_pattern hybrid_override_pattern use_kitchen_attention encoder_seq_length
        decoder_seq_length padded_vocab_size pad_vocab_size perform_initialization
        """
    ),
    MOE: _names(
        """
        moe_shared_expert_gate moe_shared_expert_glu_interleave_size moe_router_padding_for_quantization
        moe_router_padding_for_fp8 moe_router_num_groups moe_router_group_topk moe_router_pre_softmax
        moe_router_topk_scaling_factor moe_router_dtype moe_router_quantile_balancing_ema
        moe_router_force_load_balancing moe_router_force_biased moe_z_loss_coeff moe_input_jitter_eps
        moe_apply_probs_on_input moe_latent_size moe_mlp_glu_interleave_size moe_expert_rank_capacity_factor
        moe_use_upcycling moe_router_load_balancing_type
        """
    ),
    INIT: _names("init_method_xavier_uniform embedding_init_method_std data_parallel_random_init"),
    LOSS: _names("fp16_lm_cross_entropy logits_load_dir perform_rl_step"),
    DATA: _names(
        """
        dataloader_inter_document_masking
        phase_transition_iterations data_args_path per_split_data_args_path per_dataset_sequences_path
        object_storage_cache_path mid_level_dataset_surplus allow_ambiguous_pad_tokens fim_data
        iterations_to_skip dataloader_type step_batch_size_schedule decrease_batch_size_if_needed sft
        enable_msc override_ckpt_iteration
        """
    ),
    OPTIMIZER: _names(
        """
        optimizer optimizer_offload_fraction apply_wd_to_qk_layernorm no_weight_decay_cond_type decoupled_lr
        decoupled_min_lr freeze_all_layers
        """
    ),
    PRECISION: _names(
        """
        disable_bf16_reduced_precision_matmul fp8_quantizer_factory fp8_margin fp8_interval
        fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad fp8_output_proj first_last_layers_bf16 fp4
        fp4_param_gather te_precision_config_file
        """
    ),
    PARALLEL: _names(
        """
        max_seqlen_per_dp_cp_rank hybrid_context_parallel use_megatron_fsdp use_torch_fsdp2
        fake_process_group distributed_backend
        """
    ),
    TOKENIZER: _names(
        """
        vocab_extra_ids metadata_path tokenizer_sentencepiece_legacy
        tokenizer_sentencepiece_ignore_extra_whitespaces
        """
    ),
    CKPT: _names(
        """
        save_params_interval save_activations_interval save_tokens_per_expert_interval save_wgrads_interval
        save_dgrads_interval save_retain_interval non_persistent_save_interval non_persistent_ckpt_type
        non_persistent_global_ckpt_dir non_persistent_local_ckpt_dir non_persistent_local_ckpt_algo
        pretrained_checkpoint use_mp_args_from_checkpoint_args
        exit_on_missing_checkpoint ckpt_format ckpt_convert_format ckpt_convert_save
        ckpt_convert_update_legacy_dist_opt_format logits_save_dir
        """
    ),
    EVAL: _names(
        """
        start_eval_at_iter eval_global_batch_size eval_micro_batch_size skip_train test_mode full_validation
        multiple_validation_sets validation_set_names
        """
    ),
    FEATURE: _names(
        """
        rerun_mode error_injection_rate error_injection_type yaml_cfg fault_injector_ranks
        fault_injector_num_ranks fault_injector_fault_types fault_injector_fault_probabilities
        fault_injector_fault_delay fault_injector_delay_start_iteration fault_injector_mtti_seconds
        fault_injector_offset_seconds fault_injector_seed
        """
    ),
    DEPRECATED: _names(
        """
        batch_size recompute_activations checkpoint_activations warmup model_parallel_size
        use_rotary_position_embeddings
        """
    ),
}

# The refusals that change what a run computes: what a checkpoint's saved args are checked for (the others, such as
# a checkpoint format or an evaluation mode, say how Megatron ran, not what tricorn would train).
MATH = (ARCH, MOE, INIT, LOSS, DATA, OPTIMIZER, PRECISION, TOKENIZER)

# Reasons more precise than their group's, or naming tricorn's equivalent.
WHY: dict[str, str] = {
    "distributed_backend": "the process-group backend: tricorn uses gloo with --device cpu and nccl with cuda",
    "ckpt_format": "tricorn writes its own sharded DCP checkpoints (as torch_dist); tricorn export-megatron writes Megatron's",
    "rerun_mode": "tricorn does not rerun iterations (--check-for-spiky-loss skips a spiky one instead)",
    "use_megatron_fsdp": "tricorn's fully sharded data parallelism is --use-distributed-optimizer --zero-stage 3",
    "use_torch_fsdp2": "tricorn's fully sharded data parallelism is --use-distributed-optimizer --zero-stage 3",
    "fake_process_group": "tricorn's run on fake tensors and process groups is `tricorn simulate`",
    "yaml_cfg": "tricorn's YAML file is --config (docs/launching.md)",
    "batch_size": "use --micro-batch-size",
    "recompute_activations": "use --recompute-granularity selective",
    "checkpoint_activations": "use --recompute-granularity full",
    "warmup": "use --lr-warmup-iters",
    "model_parallel_size": "use --tensor-model-parallel-size",
    "use_rotary_position_embeddings": "use --position-embedding-type rope",
    "pretrained_checkpoint": "use --load with --finetune",
    "iterations_to_skip": "changes the training samples; tricorn leaves samples out with --skip-samples",
    "step_batch_size_schedule": "changes the global batch over training; tricorn's ramp is --rampup-batch-size",
    "exit_on_missing_checkpoint": "tricorn starts fresh when --load holds no checkpoint, and says so",
    "save_retain_interval": "tricorn prunes with --keep-last-n-checkpoints and keeps no checkpoint apart from it",
    "override_ckpt_iteration": "changes the data position; tricorn resumes at the checkpoint's (--ckpt-step picks one)",
    "optimizer_offload_fraction": "tricorn's --optimizer-cpu-offload offloads all of the optimizer state",
}

# ---------------------------------------------------------------- the value each refused flag may have

Ctx = dict  # the run: tricorn's field names (ModelConfig, TrainingConfig, ...) and `device`
Fine = Union[tuple, Callable[[Any, Ctx], bool]]


def _padded(ctx: Ctx) -> int:
    multiple = ctx.get("make_vocab_size_divisible_by", 128) * ctx.get("tensor_model_parallel_size", 1)
    return -(-ctx["vocab_size"] // multiple) * multiple


def _backend(value: Any, ctx: Ctx) -> bool:
    device = ctx.get("device")
    return device is None or value == {"cpu": "gloo", "cuda": "nccl"}.get(device)


def _divides(value: Any, ctx: Ctx) -> bool:
    batch, micro, dp = ctx.get("global_batch_size"), ctx.get("micro_batch_size"), ctx.get("data_parallel_size")
    return not value or None in (batch, micro, dp) or batch % (micro * dp) == 0


def _eval_batch(name: str) -> Callable[[Any, Ctx], bool]:
    return lambda value, ctx: value is None or value == ctx.get(name)


def _same(name: str) -> Callable[[Any, Ctx], bool]:
    return lambda value, ctx: value is None or value == ctx.get(name)


# Values that are what tricorn does, where Megatron's default alone is not all of them. A predicate gets the
# value and the run. Megatron's default is always fine (a flag given at its default changes nothing).
FINE: dict[str, Fine] = {
    "padded_vocab_size": lambda value, ctx: value is None or ctx.get("vocab_size") is None or value == _padded(ctx),
    "encoder_num_layers": _same("num_layers"),
    "encoder_seq_length": _same("seq_length"),
    "distributed_backend": _backend,  # gloo on --device cpu, nccl on cuda: what tricorn uses
    "decrease_batch_size_if_needed": _divides,  # nothing to decrease when micro x DP divides the batch
    "eval_global_batch_size": _eval_batch("global_batch_size"),
    "eval_micro_batch_size": _eval_batch("micro_batch_size"),
    "ckpt_format": ("torch_dist",),  # tricorn's checkpoints are DCP, as torch_dist's are
    "rerun_mode": ("disabled",),  # tricorn reruns nothing (--check-for-spiky-loss skips instead)
    "rope_type": ("rope",),
    "dataloader_type": ("single",),  # tricorn's loader is Megatron's pretraining sampler
    "optimizer": ("adam",),  # Megatron's adam is AdamW (decoupled weight decay), as tricorn's
    "moe_router_load_balancing_type": (["aux_loss"],),
}

# What FINE's predicates accept, for docs/megatron-flags.md.
FINE_TEXT: dict[str, str] = {
    "padded_vocab_size": "tricorn's padding of --vocab-size",
    "encoder_num_layers": "`--num-layers`",
    "encoder_seq_length": "`--seq-length`",
    "distributed_backend": "`gloo` with `--device cpu`, `nccl` with `cuda`",
    "decrease_batch_size_if_needed": "given when micro batch x DP divides the global batch",
    "eval_global_batch_size": "`--global-batch-size`",
    "eval_micro_batch_size": "`--micro-batch-size`",
}

# Megatron's default where tricorn's differs, for the flags that change the math: a Megatron command line
# (it gives some flag only Megatron has) without --config gets these for the flags it does not give, where
# they matter (the predicate, on the config).
MEGATRON_DEFAULTS: dict[str, tuple[Any, Callable[[Any], bool]]] = {
    "normalization": ("LayerNorm", lambda cfg: True),
    "position_embedding_type": ("learned_absolute", lambda cfg: True),
    "hidden_dropout": (0.1, lambda cfg: True),
    "attention_dropout": (0.1, lambda cfg: True),
    "initial_loss_scale": (2.0**32, lambda cfg: cfg.training.fp16 and not cfg.training.loss_scale),
    # Megatron computes its RoPE tables in float32
    "rotary_angles_dtype": ("float32", lambda cfg: cfg.model.position_embedding_type == "rope"),
    # Megatron leaves torch's default: fp32 matmuls in full fp32 on CUDA
    "tf32": (False, lambda cfg: cfg.device == "cuda" and not (cfg.training.bf16 or cfg.training.fp16)),
}
