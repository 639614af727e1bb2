"""Every Megatron-LM arg a checkpoint stores, classified: read, refused or irrelevant to the model.

Megatron-LM pickles its whole ``argparse.Namespace`` into each checkpoint (``args``). megalite
builds the model from it (:func:`megatron.model_config_from_args`), so an arg that changes the
function the weights compute must be either read into the ModelConfig (:data:`READ`) or refused
in one line when it is not at its off value (:data:`REFUSED`); every other arg is listed in
:data:`IRRELEVANT` with the reason. :func:`check_args` refuses an arg in none of the three whose
value is set (not None / False / 0 / empty): megalite cannot tell whether it changes the model.

The names are Megatron-LM core_v0.16.1's ``parse_args([])`` namespace (every ``add_argument``
and TransformerConfig field of ``megatron/training/arguments.py``), plus what its validation and
training loop set, plus older names (``norm_epsilon``, ``apply_layernorm_1p``, ...);
tests/test_megatron_args.py fails on a name of that namespace in none of the tables.
"""

from __future__ import annotations

import argparse


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Read into the ModelConfig (or checked against the files: layout, dtype, optimizer).
READ = _names(
    """
    num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention num_query_groups
    kv_channels max_position_embeddings seq_length position_embedding_type use_rotary_position_embeddings
    add_position_embedding normalization swiglu untie_embeddings_and_output_weights add_bias_linear
    add_qkv_bias openai_gelu rotary_base rotary_percent layernorm_epsilon norm_epsilon
    layernorm_zero_centered_gamma apply_layernorm_1p padded_vocab_size vocab_size megalite_vocab_size
    make_vocab_size_divisible_by init_method_std hidden_dropout attention_dropout
    qk_layernorm squared_relu rotary_interleaved
    tensor_model_parallel_size pipeline_model_parallel_size virtual_pipeline_model_parallel_size
    num_layers_per_virtual_pipeline_stage use_distributed_optimizer fp16 bf16 params_dtype
    consumed_train_samples iteration rank
    num_experts moe_ffn_hidden_size moe_layer_freq moe_router_topk moe_router_score_function
    moe_router_pre_softmax moe_router_topk_scaling_factor moe_router_num_groups moe_router_group_topk
    moe_router_dtype moe_router_load_balancing_type moe_aux_loss_coeff moe_z_loss_coeff
    moe_input_jitter_eps moe_grouped_gemm moe_shared_expert_intermediate_size moe_shared_expert_gate
    moe_expert_capacity_factor moe_token_drop_policy moe_pad_expert_input_to_capacity
    moe_router_bias_update_rate moe_router_enable_expert_bias moe_use_legacy_grouped_gemm
    expert_model_parallel_size expert_tensor_parallel_size
    """
)

# Args that change the model and that megalite does not build: {arg: (off values, feature)}.
REFUSED: dict[str, tuple[tuple, str]] = {
    "moe_apply_probs_on_input": ((None, False), "router probabilities applied to the experts' input"),
    "moe_latent_size": ((None, 0), "latent MoE (experts in a projected space)"),
    "moe_router_force_load_balancing": ((None, False), "forced load-balanced routing (a benchmark mode)"),
    "moe_extended_tp": ((None, False), "extended tensor parallelism of the experts"),
    "fp8": ((None, False), "fp8 scales"),
    "fp4": ((None, False), "fp4 scales"),
    "multi_latent_attention": ((None, False), "multi-latent attention"),
    "qk_l2_norm": ((None, False), "query/key L2 norms"),
    "quick_geglu": ((None, False), "the quick-GeGLU MLP"),
    "glu_linear_offset": ((None, 0, 0.0), "an offset GLU"),
    "activation_func_clamp_value": ((None,), "a clamped activation"),
    "mtp_num_layers": ((None, 0), "multi-token prediction layers"),
    "use_rope_scaling": ((None, False), "Llama-3.1 RoPE frequency scaling"),
    "rope_type": ((None, "rope"), "another RoPE variant (YaRN)"),
    "rotary_seq_len_interpolation_factor": ((None, 1, 1.0), "RoPE position interpolation"),
    "no_rope_freq": ((None, 0, []), "layers without RoPE"),
    "mrope_section": ((None,), "multimodal RoPE"),
    "window_size": ((None,), "sliding-window attention"),
    "window_attn_skip_freq": ((None,), "sliding-window attention"),
    "apply_residual_connection_post_layernorm": ((None, False), "residuals taken after the layer norm"),
    "attention_output_gate": ((None, False), "gated attention output"),
    "softmax_type": ((None, "vanilla"), "another attention softmax (sinks)"),
    "experimental_attention_variant": ((None,), "an experimental attention variant"),
    "linear_attention_freq": ((None,), "linear-attention layers"),
    "use_kitchen_attention": ((None, False), "quantised (kitchen) attention"),
    "is_hybrid_model": ((None, False), "a hybrid (Mamba) model"),
    "hybrid_override_pattern": ((None,), "a hybrid (Mamba) model"),
    "hybrid_attention_ratio": ((None, 0, 0.0), "a hybrid (Mamba) model"),
    "hybrid_mlp_ratio": ((None, 0, 0.0), "a hybrid (Mamba) model"),
    "heterogeneous_layers_config_path": ((None,), "heterogeneous layers"),
    "heterogeneous_layers_config_encoded_json": ((None,), "heterogeneous layers"),
    "spec": ((None,), "a custom layer spec"),
}

IRRELEVANT: dict[str, tuple[str, frozenset[str]]] = {
    "only_with_refused": (
        "act only with a feature refused above (Mamba, MTP, DSA, linear attention, fp8/fp4, relative positions, QK-clip, RoPE scaling, MLA)",
        _names(
            """
            cache_mla_latents dsa_indexer_head_dim dsa_indexer_loss_coeff dsa_indexer_n_heads
            dsa_indexer_topk dsa_indexer_use_sparse_loss fp4_param fp4_quantizer_factory fp4_recipe
            fp8_amax_compute_algo fp8_amax_history_len fp8_interval fp8_margin fp8_quantizer_factory
            fp8_recipe fp8_wgrad kv_lora_rank linear_conv_kernel_dim linear_key_head_dim
            linear_num_key_heads linear_num_value_heads linear_value_head_dim mamba_head_dim
            mamba_num_groups mamba_num_heads mamba_state_dim moe_router_padding_for_fp8
            moe_router_padding_for_quantization mscale mscale_all_dim mtp_loss_scaling_factor
            mtp_standalone q_lora_rank qk_clip qk_clip_alpha qk_clip_threshold qk_head_dim
            qk_pos_emb_head_dim relative_attention_max_distance relative_attention_num_buckets
            rope_scaling_factor rotary_scaling_factor v_head_dim
            """
        ),
    ),
    "moe_runtime": (
        "MoE settings that do not change the function of the stored weights: token dispatchers, fusions, "
        "communication overlap, recomputation, logging, upcycling (a load-time transform), inference",
        _names(
            """
            moe_token_dispatcher_type moe_enable_deepep moe_flex_dispatcher_backend moe_deepep_num_sms
            moe_hybridep_num_sms moe_permute_fusion moe_router_fusion moe_shared_expert_overlap
            moe_layer_recompute moe_per_layer_logging moe_use_upcycling moe_upcycling_granularity
            moe_enable_routing_replay moe_pad_experts_for_cuda_graph_inference
            """
        ),
    ),
    "network_size": (
        "network-size args that do not change the function of the stored weights: layouts, fusions, kernels, recomputation, communication overlap, precision policies, init",
        _names(
            """
            account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
            apply_query_key_layer_scaling async_tensor_model_parallel_allreduce attention_backend
            batch_invariant_mode bert_binary_head calculate_per_token_loss
            clone_scatter_output_in_embedding config_logger_dir context_parallel_size
            cpu_offloading_num_layers cross_entropy_fusion_impl cross_entropy_loss_fusion
            cuda_graph_impl cuda_graph_warmup_steps decoder_num_layers defer_embedding_wgrad_compute
            delay_wgrad_compute deterministic_mode disable_bf16_reduced_precision_matmul
            distribute_saved_activations embedding_init_method_std enable_cuda_graph
            encoder_num_layers ep_overlap_early_attn_memory_release external_cuda_graph fine_grained_activation_offloading
            first_last_layers_bf16 flash_decode fp32_residual_connection
            hierarchical_context_parallel_sizes hybrid_context_parallel
            inference_fuse_tp_communication init_model_with_meta_device kitchen_attention_backend
            max_seqlen_per_dp_cp_rank microbatch_group_size_per_vp_stage min_offloaded_tensor_size
            mlp_chunks_for_prefill num_layers_at_end_in_bf16 num_layers_at_start_in_bf16
            offload_modules onnx_safe overlap_moe_expert_parallel_comm overlap_p2p_comm_warmup_flush
            perform_initialization pipeline_model_parallel_comm_backend recompute_granularity
            recompute_method recompute_modules recompute_num_layers sequence_parallel
            symmetric_ar_type tp_comm_bootstrap_backend tp_comm_bulk_dgrad tp_comm_bulk_wgrad
            tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
            tp_comm_split_ag tp_comm_split_rs transformer_impl use_cpu_initialization
            use_fused_weighted_squared_relu use_mamba_mem_eff_path
            use_ring_exchange_p2p use_te_activation_func wgrad_deferral_limit
            """
        ),
    ),
    "autoresume": (
        "job scheduling",
        _names(
            """
            adlr_autoresume adlr_autoresume_interval
            """
        ),
    ),
    "biencoder": (
        "retrieval / biencoder models (not GPT)",
        _names(
            """
            bert_load biencoder_projection_dim biencoder_shared_query_context_model block_data_path
            embedding_path evidence_data_path ict_head_size ict_load indexer_batch_size
            indexer_log_interval query_in_block_prob retriever_report_topk_accuracies
            retriever_score_scaling titles_data_path use_one_sent_docs
            """
        ),
    ),
    "checkpointing": (
        "how checkpoints are written and loaded",
        _names(
            """
            async_save auto_detect_ckpt_format ckpt_assume_constant_structure ckpt_convert_format
            ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format ckpt_format
            ckpt_fully_parallel_load ckpt_fully_parallel_save ckpt_fully_parallel_save_deprecated
            ckpt_step dist_ckpt_format_deprecated dist_ckpt_optim_fully_reshardable
            dist_ckpt_save_pre_mcore_014 dist_ckpt_strictness
            distrib_optim_fully_reshardable_mem_efficient exit_on_missing_checkpoint finetune load
            load_main_params_from_ckpt no_load_optim no_load_rng no_save_optim no_save_rng
            non_persistent_ckpt_type non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo
            non_persistent_local_ckpt_dir non_persistent_save_interval pretrained_checkpoint
            replication replication_factor replication_jump save save_dgrads_interval save_interval
            save_retain_interval save_wgrads_interval strict_fsdp_dtensor_load use_checkpoint_args
            use_dist_ckpt_deprecated use_mp_args_from_checkpoint_args use_persistent_ckpt_worker
            use_tokenizer_model_from_checkpoint_args
            """
        ),
    ),
    "data": (
        "the data pipeline",
        _names(
            """
            allow_ambiguous_pad_tokens create_attention_mask_in_dataloader data_args_path
            data_cache_path data_path dataloader_defer_npy_index_mmap dataloader_fast_cache_load
            decoder_seq_length encoder_seq_length eod_mask_loss fim_data fim_eod_token
            fim_fragment_rate fim_middle_token fim_no_prefix fim_pad_token fim_prefix_token fim_rate
            fim_split_sample fim_spm_rate fim_suffix_token mask_prob mid_level_dataset_surplus
            mmap_bin_files mock_data num_dataset_builder_threads num_workers
            object_storage_cache_path per_dataset_sequences_path per_split_data_args_path
            phase_transition_iterations reset_attention_mask reset_position_ids sample_rate
            short_seq_prob split test_data_path train_data_path valid_data_path
            """
        ),
    ),
    "distributed": (
        "the parallel layout and communication (the weights are read whole)",
        _names(
            """
            align_grad_reduce align_param_gather cp_comm_type create_all_gather_group
            data_parallel_sharding_strategy ddp_average_in_collective ddp_bucket_size
            ddp_num_buckets ddp_pad_buckets_for_high_nccl_busbw
            ddp_reduce_scatter_with_fp32_accumulation decoder_first_pipeline_num_layers
            decoder_last_pipeline_num_layers disable_symmetric_registration distributed_backend
            distributed_timeout_minutes distributed_timeout_seconds_after_init
            enable_full_sharding_in_hsdp fake_process_group fsdp_double_buffer
            fsdp_manual_registration gradient_reduce_div_fusion keep_fp8_transpose_cache
            lazy_mpu_init local_rank model_parallel_size nccl_communicator_config_path nccl_ub
            num_distributed_optimizer_instances num_virtual_stages_per_pipeline_rank
            outer_dp_sharding_strategy overlap_grad_reduce overlap_p2p_comm overlap_param_gather
            overlap_param_gather_with_optimizer_step pipeline_model_parallel_layout
            scatter_gather_tensors_in_pipeline sharp_enabled_group suggested_communication_unit_size
            torch_fsdp2_reshard_after_forward use_megatron_fsdp use_sharp use_torch_fsdp2
            use_tp_pp_dp_mapping
            """
        ),
    ),
    "experimental": (
        "optimizer-state dtypes and experimental switches",
        _names(
            """
            enable_experimental exp_avg_dtype exp_avg_sq_dtype main_grads_dtype main_params_dtype
            use_precision_aware_optimizer yaml_cfg
            """
        ),
    ),
    "ft_package": (
        "fault tolerance",
        _names(
            """
            calc_ft_timeouts enable_ft_package ft_num_warmup_iters
            """
        ),
    ),
    "inference": (
        "the inference engine",
        _names(
            """
            bert_embedder_type cuda_graph_scope decode_only_cuda_graphs disable_chunked_prefill
            inference_batch_times_seqlen_threshold inference_coordinator_port
            inference_dynamic_batching inference_dynamic_batching_block_size
            inference_dynamic_batching_buffer_size_gb
            inference_dynamic_batching_cuda_graph_max_tokens
            inference_dynamic_batching_cuda_graph_mixed_prefill_count
            inference_dynamic_batching_max_requests inference_dynamic_batching_max_tokens
            inference_dynamic_batching_num_cuda_graphs
            inference_dynamic_batching_paused_buffer_size_gb
            inference_dynamic_batching_track_paused_request_events
            inference_dynamic_batching_unified_memory_level inference_logging_step_interval
            inference_max_batch_size inference_max_seq_length inference_wandb_logging
            max_tokens_to_oom nccl_all_reduce_for_prefill output_bert_embeddings
            use_legacy_static_engine
            """
        ),
    ),
    "initialization": (
        "initial weights and RNG (replaced by the stored weights)",
        _names(
            """
            data_parallel_random_init inference_rng_tracker init_method_xavier_uniform seed
            te_rng_tracker
            """
        ),
    ),
    "inprocess_restart": (
        "fault tolerance",
        _names(
            """
            inprocess_active_world_size inprocess_barrier_timeout inprocess_completion_timeout
            inprocess_empty_cuda_cache inprocess_granularity inprocess_hard_timeout
            inprocess_heartbeat_interval inprocess_heartbeat_timeout inprocess_last_call_wait
            inprocess_max_iterations inprocess_monitor_process_interval
            inprocess_monitor_thread_interval inprocess_progress_watchdog_interval inprocess_restart
            inprocess_soft_timeout inprocess_termination_grace_time
            """
        ),
    ),
    "learning_rate": (
        "the LR schedule",
        _names(
            """
            decoupled_lr decoupled_min_lr end_weight_decay lr lr_decay_iters lr_decay_samples
            lr_decay_style lr_warmup_fraction lr_warmup_init lr_warmup_iters lr_warmup_samples
            lr_wsd_decay_iters lr_wsd_decay_samples lr_wsd_decay_style min_lr
            override_opt_param_scheduler start_weight_decay use_checkpoint_opt_param_scheduler
            warmup weight_decay_incr_style
            """
        ),
    ),
    "logging": (
        "logging",
        _names(
            """
            barrier_with_L1_time log_device_memory_used log_energy log_interval
            log_loss_scale_to_tensorboard log_max_attention_logit log_memory_interval
            log_memory_to_tensorboard log_num_zeros_in_grad log_params_norm log_progress
            log_throughput log_timers_to_tensorboard log_validation_ppl_to_tensorboard
            log_world_size_to_tensorboard logging_level tensorboard_dir tensorboard_log_interval
            tensorboard_queue_size timing_log_level timing_log_option wandb_entity wandb_exp_name
            wandb_project wandb_save_dir
            """
        ),
    ),
    "mixed_precision": (
        "loss scaling and mixed-precision numerics (fp16 / bf16 are read above)",
        _names(
            """
            accumulate_allreduce_grads_in_fp32 attention_softmax_in_fp32 fp16_lm_cross_entropy
            grad_reduce_in_bf16 hysteresis initial_loss_scale loss_scale loss_scale_window
            min_loss_scale reuse_grad_buf_for_mxfp8_param_ag
            """
        ),
    ),
    "msc": (
        "storage clients",
        _names(
            """
            enable_msc
            """
        ),
    ),
    "one_logger": (
        "logging",
        _names(
            """
            app_tag_run_name app_tag_run_version enable_one_logger one_logger_async
            one_logger_project one_logger_run_name
            """
        ),
    ),
    "regularization": (
        "optimizer and regularisation settings (the weights are what they are)",
        _names(
            """
            adam_beta1 adam_beta2 adam_eps apply_wd_to_qk_layernorm clip_grad
            muon_extra_scale_factor muon_fp32_matmul_prec muon_momentum muon_num_ns_steps
            muon_scale_mode muon_split_qkv muon_tp_mode muon_use_nesterov no_weight_decay_cond_type
            sgd_momentum weight_decay
            """
        ),
    ),
    "rerun_machine": (
        "fault tolerance",
        _names(
            """
            check_for_spiky_loss error_injection_rate error_injection_type rerun_mode
            """
        ),
    ),
    "rl": (
        "reinforcement-learning runs",
        _names(
            """
            grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_entropy_term_weight
            grpo_filter_groups_with_same_reward grpo_group_size grpo_iterations grpo_kl_beta
            grpo_prompts_per_step langrl_env_config langrl_external_server
            langrl_inference_server_conversation_template langrl_inference_server_type
            perform_rl_step refit_method rl_default_temperature rl_default_top_k rl_default_top_p
            rl_importance_sampling_truncation_coef rl_inference_expert_model_parallel_size
            rl_inference_expert_tensor_model_parallel_size rl_inference_logprobs_is_correction
            rl_inference_model_unified_memory_level rl_inference_pipeline_model_parallel_size
            rl_inference_tensor_model_parallel_size rl_offload_inference_model_weights_when_idle
            rl_offload_kv_cache_during_training rl_offload_optimizer_during_inference
            rl_parallel_generation_tasks rl_partial_rollouts rl_prompts_per_eval
            rl_remove_kv_cache_during_training rl_reset_cuda_graphs rl_sequence_packing_algo
            rl_sequence_packing_max_sequences_per_bin rl_skip_bos_token rl_training_cuda_graphs
            rl_use_sequence_packing rl_verify_model_weights_swap
            """
        ),
    ),
    "sft": (
        "the fine-tuning data format",
        _names(
            """
            sft sft_tokenizer_prompt_format
            """
        ),
    ),
    "straggler_detector": (
        "monitoring",
        _names(
            """
            disable_straggler_on_startup log_straggler straggler_ctrlr_port straggler_minmax_count
            """
        ),
    ),
    "tokenizer": (
        "the tokenizer (the vocabulary size is read from padded_vocab_size)",
        _names(
            """
            legacy_tokenizer merge_file tiktoken_num_special_tokens tiktoken_pattern
            tiktoken_special_tokens tokenizer_hf_include_special_tokens tokenizer_hf_use_fast
            tokenizer_metadata tokenizer_model tokenizer_sentencepiece_legacy
            tokenizer_special_tokens tokenizer_type trust_remote_code vocab_extra_ids vocab_file
            """
        ),
    ),
    "training": (
        "the training loop, fusions, schedules and profiling",
        _names(
            """
            apply_rope_fusion batch_size bias_dropout_fusion bias_gelu_fusion bias_swiglu_fusion
            check_for_large_grads check_for_nan_in_loss_and_grad
            check_weight_hash_across_dp_replicas_interval checkpoint_activations dataloader_type
            decrease_batch_size_if_needed deprecated_use_mcore_models disable_jit_fuser
            dump_param_to_param_group_map empty_unused_memory_level enable_gloo_process_groups
            exit_duration_in_mins exit_interval exit_signal exit_signal_handler
            exit_signal_handler_for_dataloader global_batch_size gradient_accumulation_fusion
            high_priority_stream_groups iterations_to_skip manual_gc manual_gc_eval
            manual_gc_interval masked_softmax_fusion memory_snapshot_path micro_batch_size
            no_persist_layer_norm optimizer optimizer_cpu_offload optimizer_offload_fraction
            overlap_cpu_optimizer_d2h_h2d pin_cpu_grads pin_cpu_params profile profile_ranks
            profile_step_end profile_step_start rampup_batch_size recompute_activations
            record_memory_history result_rejected_tracker_filename tp_comm_overlap_cfg train_iters
            train_samples train_sync_interval use_flash_attn use_legacy_models use_pytorch_profiler
            use_torch_optimizer_for_cpu_offload
            """
        ),
    ),
    "transformer_engine": (
        "Transformer Engine precision options",
        _names(
            """
            fp8_param_gather te_precision_config_file
            """
        ),
    ),
    "validation": (
        "evaluation",
        _names(
            """
            eval_interval eval_iters full_validation multiple_validation_sets skip_train test_mode
            """
        ),
    ),
    "vision": (
        "vision models (not GPT)",
        _names(
            """
            classes_fraction data_per_class_fraction data_sharding dino_bottleneck_size
            dino_freeze_last_layer dino_head_hidden_size dino_local_crops_number dino_local_img_size
            dino_norm_last_layer dino_teacher_temp dino_warmup_teacher_temp
            dino_warmup_teacher_temp_epochs head_lr_mult img_h img_w iter_per_epoch mask_factor
            mask_type num_channels num_classes patch_dim swin_backbone_type vision_backbone_type
            vision_pretraining vision_pretraining_type
            """
        ),
    ),
    "workload_inspector_server": (
        "monitoring",
        _names(
            """
            run_workload_inspector_server
            """
        ),
    ),
    "set_by_megatron": (
        "set by Megatron-LM's validation or training loop (sizes, counters, derived layouts), or older names",
        _names(
            """
            consumed_train_bins consumed_valid_samples cpu_offloading data_parallel_size grpo_samples_per_iteration
            skipped_train_samples transformer_pipeline_model_parallel_size use_custom_fsdp variable_seq_lengths
            world_size use_dist_ckpt num_floating_point_operations_so_far
            """
        ),
    ),
}
_SET = (None, False, 0, 0.0, "", (), [])


def classified(name: str) -> bool:
    return name in READ or name in REFUSED or any(name in names for _, names in IRRELEVANT.values())


def check_args(args: argparse.Namespace, where: str, error) -> None:
    """Refuse (``error(msg)``) a stored arg that changes the model in a way megalite does not
    build, or one megalite has not classified whose value is set."""
    for name, value in sorted(vars(args).items()):
        if name in REFUSED:
            off, feature = REFUSED[name]
            if not any(value is o or (type(value) is type(o) and value == o) for o in off):
                raise error(
                    f"{where}: {feature} (args.{name}={value!r}) — megalite does not build it, "
                    "so this checkpoint cannot be read as the same model"
                )
        elif not classified(name) and not any(
            value is o or value == o for o in _SET if type(o) is type(value)
        ):
            raise error(
                f"{where}: args.{name}={value!r} is not in megalite's table of Megatron-LM args "
                "(megalite/checkpoint/megatron_args.py), so megalite cannot tell whether it changes the model"
            )
