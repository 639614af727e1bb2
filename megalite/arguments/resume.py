"""Resume policy: every training flag is in exactly one class, decided here once.

* ``model``: the model's identity (:meth:`megalite.model.config.ModelConfig.identity`), compared when
  the checkpoint is loaded; a change stops the run naming the flag and both values.
* ``identity``: the run's other identity, above all its data order (``--split``, ``--seed``, the
  ``--data-path`` blend, ``--seq-length``, mock data) and the tokenizer's id mapping: a change on
  resume stops the run (it would turn training documents into validation data, reshuffle the
  samples, or change what the ids mean). ``--finetune`` starts a new run: only ``model`` applies.
* ``schedule``: the LR / weight-decay schedule; Megatron's ``--override-opt_param-scheduler``
  (this command line wins) or ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's wins)
  decide, neither stops the run (the scheduler itself compares its own values).
* ``free``: may change; start-up prints one note line listing each change.
* ``invocation``: how this invocation starts, stops and where it writes (``--load``, ``--save``,
  exits): free, not noted.

tests/test_arguments.py walks the parser and fails on a flag without a class.
"""

import os

from megalite.data.blended_dataset import normalize_weights
from megalite.data.builder import parse_data_path
from megalite.data.gpt_dataset import DatasetError, parse_split
from megalite.errors import ArgumentError

MODEL, IDENTITY, SCHEDULE, FREE, INVOCATION = "model", "identity", "schedule", "free", "invocation"


def _classes(**groups: str) -> dict[str, str]:
    return {dest: cls for cls, dests in groups.items() for dest in dests.split()}


POLICY = _classes(
    model="apply_layernorm_1p disable_bias_linear ffn_hidden_size group_query_attention hidden_size "
    "kv_channels max_position_embeddings norm_epsilon normalization num_attention_heads num_layers "
    "num_query_groups openai_gelu position_embedding_type rotary_base rotary_percent swiglu "
    "squared_relu rotary_interleaved qk_layernorm add_qkv_bias "
    "untie_embeddings_and_output_weights vocab_size num_experts moe_ffn_hidden_size moe_layer_freq moe_router_topk "
    "moe_router_score_function moe_router_pre_softmax moe_router_topk_scaling_factor moe_router_num_groups "
    "moe_router_group_topk moe_router_dtype moe_router_enable_expert_bias moe_shared_expert_intermediate_size "
    "moe_shared_expert_gate moe_expert_capacity_factor moe_token_drop_policy moe_pad_expert_input_to_capacity",
    identity="split seed data_path mock_data seq_length tokenizer_type tiktoken_pattern "
    "tiktoken_num_special_tokens tiktoken_special_tokens",
    schedule="lr min_lr lr_decay_style lr_warmup_iters lr_decay_iters lr_warmup_samples lr_decay_samples "
    "lr_warmup_fraction lr_warmup_init decoupled_lr decoupled_min_lr weight_decay start_weight_decay "
    "end_weight_decay weight_decay_incr_style",
    free="attention_dropout hidden_dropout init_method_std make_vocab_size_divisible_by "
    "calculate_per_token_loss transformer_impl recompute_activations recompute_granularity recompute_method "
    "recompute_num_layers sequence_parallel cross_entropy_loss_fusion torch_compile torch_compile_mode "
    "decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers distributed_backend "
    "num_layers_per_virtual_pipeline_stage pipeline_model_parallel_size pipeline_schedule "
    "tensor_model_parallel_size accumulate_allreduce_grads_in_fp32 data_parallel_sharding_strategy "
    "ddp_bucket_size grad_reduce_in_bf16 overlap_grad_reduce overlap_param_gather "
    "overlap_param_gather_with_optimizer_step use_distributed_optimizer use_megatron_fsdp use_torch_fsdp2 "
    "global_batch_size micro_batch_size rampup_batch_size step_batch_size_schedule train_iters train_samples "
    "adam_beta1 adam_beta2 adam_eps clip_grad bf16 fp16 hysteresis initial_loss_scale loss_scale "
    "loss_scale_window min_loss_scale optimizer_cpu_offload optimizer_offload_fraction offload_optimizer_device "
    "offload_param_device offload_nvme_path offload_buffer_count offload_buffer_size offload_sub_group_size "
    "overlap_cpu_optimizer_d2h_h2d data_cache_path eod_mask_loss num_workers merge_file tokenizer_model "
    "vocab_file check_for_nan_in_loss_and_grad attention_backend context_parallel_size cp_comm_type "
    "hierarchical_context_parallel_sizes num_distributed_optimizer_instances "
    "gradient_accumulation_fusion deterministic_mode moe_aux_loss_coeff moe_z_loss_coeff moe_router_bias_update_rate "
    "moe_input_jitter_eps moe_grouped_gemm moe_token_dispatcher_type moe_router_load_balancing_type "
    "expert_model_parallel_size expert_tensor_parallel_size moe_layer_recompute",
    invocation="config override_opt_param_scheduler use_checkpoint_opt_param_scheduler eval_interval "
    "eval_iters log_interval logging_level metrics_file peak_tflops tensorboard_dir log_loss_scale_to_tensorboard "
    "log_memory_to_tensorboard log_num_zeros_in_grad log_params_norm log_throughput log_timers_to_tensorboard "
    "log_validation_ppl_to_tensorboard log_world_size_to_tensorboard tensorboard_log_interval "
    "tensorboard_queue_size wandb_entity wandb_exp_name wandb_project wandb_save_dir manual_gc manual_gc_eval "
    "manual_gc_interval memory_snapshot_path profile profile_dir profile_ranks profile_step_end "
    "profile_step_start pytorch_profiler_collect_callstack pytorch_profiler_collect_shapes "
    "record_memory_history timing_log_level timing_log_option use_pytorch_profiler "
    "distributed_timeout_minutes ckpt_step exit_duration_in_mins exit_interval exit_signal_handler finetune "
    "load no_load_optim no_load_rng save save_interval async_save use_persistent_ckpt_worker fake_world_size fake_rank fake_tensors fake_real_tensors",
)
# The schedule flags the scheduler does not compare itself (a param group's own LR): checked here.
_OWN_SCHEDULE = ("decoupled_lr", "decoupled_min_lr")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def _meaning(dest: str, v):
    """What a value determines, compared instead of its spelling: ``--split`` as normalised shares
    (49,1,0 == 98,2,0), ``--data-path`` as resolved files with normalised blend weights (a relative
    and an absolute path to the same prefix, weights scaled, are the same run)."""
    try:
        if dest == "split" and v is not None:
            return [round(x, 12) for x in parse_split(v)]
        if dest == "data_path" and v:
            prefixes, weights = parse_data_path(v)
            shares = None if weights is None else [round(w, 12) for w in normalize_weights(weights)]
            return [os.path.realpath(p) for p in prefixes], shares
    except DatasetError:  # unparsable: compared as typed (flag resolution has refused it already)
        return _norm(v)
    return _norm(v)


def resume_policy(recorded: dict, flags: dict) -> tuple[list[str], dict]:
    """Compare this run's resolved flags (``flags``: ``RunConfig.checkpoint.flags``, dest -> value) with
    the flags a checkpoint recorded (the same record, of the run that wrote it).

    Stops (ArgumentError naming the flag and both values) on a changed ``identity`` flag, or a changed
    ``--decoupled-lr`` / ``--decoupled-min-lr`` without Megatron's override / keep flag. Returns the notes
    (the changed ``free`` flags in one line, what the schedule flags decided) and the values this run
    takes from the checkpoint instead (``--use-checkpoint-opt_param-scheduler``: ``{dest: value}``).
    """
    changed = {
        d: (recorded[d], flags[d])
        for d in POLICY
        if d in recorded and d in flags and _meaning(d, recorded[d]) != _meaning(d, flags[d])
    }
    described = {d: f"{_flag(d)} {new} (checkpoint {old})" for d, (old, new) in changed.items()}
    identity = [described[d] for d in changed if POLICY[d] == IDENTITY]
    if identity:
        raise ArgumentError(
            "resuming with a changed run identity (data order / tokenizer): "
            + ", ".join(identity)
            + "; restore the checkpoint's values, or start a new run (--finetune, a new --save)"
        )
    notes, kept = [], {}
    own = [d for d in _OWN_SCHEDULE if d in changed]
    if own and flags.get("use_checkpoint_opt_param_scheduler"):
        kept = {d: changed[d][0] for d in own}
        notes.append("--use-checkpoint-opt_param-scheduler keeps " + ", ".join(described[d] for d in own))
    elif own and flags.get("override_opt_param_scheduler"):
        notes.append(
            "--override-opt_param-scheduler: this command line's " + ", ".join(described[d] for d in own)
        )
    elif own:
        raise ArgumentError(
            "the LR schedule differs from the checkpoint's: "
            + ", ".join(described[d] for d in own)
            + "; pass --override-opt_param-scheduler to use this command line's, or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )
    free = [described[d] for d in changed if POLICY[d] == FREE]
    if free:
        notes.append("changed since the checkpoint: " + ", ".join(free))
    return notes, kept
