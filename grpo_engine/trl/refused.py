"""Where each field of TRL's GRPOConfig goes: :data:`MAPPED` (field -> the native setting it becomes) and
:data:`REFUSED` (field -> why it has no equivalent here, the nearest setting). Every TRL field is in exactly
one of them (a test checks). A refused field at TRL's default is fine: it changes nothing in TRL's run that
this run does not do; set to anything else it is refused by name (:mod:`grpo_engine.trl.mapping`).
"""

from __future__ import annotations

from grpo_engine.config import UNKNOWN_FIELD_HINTS

__all__ = ["MAPPED", "REFUSED", "native_hint"]

_CFG, _MEM = "GRPOConfig", "MemoryPlan"
MAPPED: dict[str, str] = {
    "output_dir": f"{_CFG}.output_dir",
    "per_device_train_batch_size": f"{_CFG}.prompts_per_step (with the generation batch), "
                                   f"{_MEM}.micro_batch_size",
    "gradient_accumulation_steps": f"{_CFG}.prompts_per_step (with the generation batch)",
    "generation_batch_size": f"{_CFG}.prompts_per_step x group_size",
    "steps_per_generation": f"{_CFG}.prompts_per_step (must equal gradient_accumulation_steps)",
    "num_generations": f"{_CFG}.group_size",
    "max_completion_length": f"{_CFG}.max_completion_tokens",
    "num_iterations": f"{_CFG}.updates_per_batch",
    "max_steps": f"{_CFG}.max_steps (ceil(steps / num_iterations))",
    "num_train_epochs": f"{_CFG}.max_steps (with max_steps=-1)",
    "learning_rate": f"{_CFG}.learning_rate",
    "lr_scheduler_type": "transformers.get_scheduler over the run's steps",
    "lr_scheduler_kwargs": "transformers.get_scheduler(scheduler_specific_kwargs=...)",
    "warmup_steps": "the schedule's warm-up (a float below 1: a fraction of the run)",
    "weight_decay": f"{_CFG}.weight_decay",
    "adam_beta1": f"{_CFG}.adam_betas[0]",
    "adam_beta2": f"{_CFG}.adam_betas[1]",
    "adam_epsilon": f"{_CFG}.adam_eps",
    "optim": f"{_MEM}.optimizer (the AdamW variants)",
    "max_grad_norm": f"{_CFG}.max_grad_norm (0: off)",
    "seed": f"{_CFG}.seed",
    "bf16": f"{_MEM}.compute_dtype='bfloat16'",
    "fp16": f"{_MEM}.compute_dtype='float16'",
    "use_cpu": "bf16 on the CPU, as TRL does with it",
    "gradient_checkpointing": f"{_MEM}.gradient_checkpointing",
    "activation_checkpointing": f"{_MEM}.gradient_checkpointing",
    "torch_compile": f"{_MEM}.compile_training",
    "model_init_kwargs": f"{_MEM}.dtype (its 'dtype' key only)",
    "disable_dropout": "dropout is always off here (memory.apply.prepare_model), TRL's True",
    "logging_steps": f"{_CFG}.log_every_steps",
    "save_strategy": f"{_CFG}.save_every_steps ('steps', 'epoch'; 'no': none)",
    "logging_strategy": f"{_CFG}.log_every_steps ('steps', 'epoch'; 'no': none)",
    "save_steps": f"{_CFG}.save_every_steps",
    "save_total_limit": f"{_CFG}.keep_last_checkpoints",
    "eval_strategy": "HeldOutEval ('steps', 'epoch')",
    "eval_steps": "HeldOutEval(every_steps=...)",
    "do_eval": "set from eval_strategy",
    "disable_tqdm": f"{_CFG}.progress_bar",
    "log_completions": "CompletionLog: output_dir/completions.jsonl and the log, every logging_steps",
    "num_completions_to_print": "CompletionLog's rows logged (all: None)",
    "report_to": f"{_CFG}.report_to",
    "run_name": "WANDB_NAME for report_to=['wandb']",
    "temperature": f"{_CFG}.temperature",
    "top_p": f"{_CFG}.top_p",
    "top_k": f"{_CFG}.top_k",
    "max_tool_calling_iterations": f"{_CFG}.max_turns - 1",
    "beta": "the loss's kl_coef",
    "epsilon": "the loss's clip_eps_low",
    "epsilon_high": "the loss's clip_eps_high (CISPO: clip_eps_high + 1)",
    "delta": "ClippedSurrogate.delta",
    "loss_type": "the loss: ClippedSurrogate aggregation, CISPO, SAPO, LUSPO, VESPO",
    "vespo_k_pos": "VESPO(k_pos=...) (loss_type='vespo')", "vespo_lambda_pos": "VESPO(lambda_pos=...)",
    "vespo_k_neg": "VESPO(k_neg=...)", "vespo_lambda_neg": "VESPO(lambda_neg=...)",
    "sapo_temperature_pos": "SAPO(temperature_pos=...) (loss_type='sapo')",
    "sapo_temperature_neg": "SAPO(temperature_neg=...) (loss_type='sapo')",
    "importance_sampling_level": "GSPO, LUSPO ('sequence')",
    "use_bias_correction_kl": "with beta: ClippedSurrogate(kl_ratio_weighted=True) (True), the k3 KL (False)",
    "off_policy_mask_threshold": "ClippedSurrogate(off_policy_mask_threshold=...) (DeepSeek-V3.2's mask)",
    "entropy_coef": "ClippedSurrogate(entropy_coef=...) (the token-mean loss, one micro-batch a step); "
                    "AdaptiveEntropyBonus(coef=...) under use_adaptive_entropy",
    "use_adaptive_entropy": "an AdaptiveEntropyBonus loss term and callback (Skywork-OR1)",
    "entropy_coef_min": "AdaptiveEntropyBonus(coef_min=...)",
    "entropy_coef_max": "AdaptiveEntropyBonus(coef_max=...)",
    "entropy_coef_delta": "AdaptiveEntropyBonus(delta=...)",
    "entropy_target": "AdaptiveEntropyBonus(entropy_target=...)",
    "multi_objective_aggregation": "'normalize_then_sum': WeightedSum(normalize='each', eps=1e-4) + "
                                   "ReinforcePlusPlusBaseline(eps=1e-4) (GDPO)",
    "sync_ref_model": "a ReferenceSync callback (TR-DPO; full fine-tuning with beta > 0)",
    "ref_model_mixup_alpha": "ReferenceSync(alpha=...)",
    "ref_model_sync_steps": "ReferenceSync(every_steps=ref_model_sync_steps / num_iterations)",
    "scale_rewards": "GroupNormalized(std_scope=..., eps=1e-4)",
    "mask_truncated_completions": "ClippedSurrogate.mask_truncated",
    "top_entropy_quantile": "ClippedSurrogate.top_entropy_quantile",
    "reward_weights": "each reward's weight (FunctionReward)",
    "use_vllm": "a vLLM sampler: VLLMSampler ('colocate') or VLLMServerSampler ('server')",
    "vllm_mode": "VLLMSampler ('colocate') or VLLMServerSampler ('server')",
    "vllm_model_impl": "VLLMSampler(engine_kwargs={'model_impl': ...})",
    "vllm_enable_sleep_mode": "VLLMSampler(sleep_between_steps=...)",
    "vllm_gpu_memory_utilization": "VLLMSampler(gpu_memory_utilization=...)",
    "vllm_server_base_url": "VLLMServerSampler(base_url=...)",
    "vllm_server_host": "VLLMServerSampler(base_url='http://host:port')",
    "vllm_server_port": "VLLMServerSampler(base_url='http://host:port')",
    "vllm_max_model_length": "max_prompt_tokens + max_completion_tokens under use_vllm",
    "vllm_importance_sampling_correction": "ClippedSurrogate(tis_cap=..., tis_mode=...) under use_vllm",
    "vllm_importance_sampling_mode": "ClippedSurrogate(tis_mode=...) under use_vllm",
    "vllm_importance_sampling_clip_max": "ClippedSurrogate(tis_cap=...) under use_vllm",
    "vllm_importance_sampling_clip_min": "ClippedSurrogate(tis_cap_min=...) under use_vllm",
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max (deprecated by TRL)",
    "remove_unused_columns": "every column reaches the reward functions (TRL's default)",
    "push_to_hub": "GRPOTrainer.push_to_hub at the end of train() and in save_model (grpo_engine.trl.hub)",
    "hub_model_id": "the repository push_to_hub uploads to (default: the output_dir folder's name)",
    "hub_token": "push_to_hub's token", "hub_private_repo": "push_to_hub's private repository",
    "hub_revision": "push_to_hub's branch",
    "hub_strategy": "'every_save' / 'end': pushed at the end of train(); the checkpoint strategies refused",
    "per_device_eval_batch_size": "HeldOutEval samples the eval prompts greedily in its own batches",
}

_NO_EVAL = ("evaluation here is HeldOutEval's greedy pass@1 every eval_steps steps",
            "eval_strategy='steps', eval_steps=N, or trainer.evaluate(prompts) on the native trainer")
_SPEED = "the native trainer builds its own data pipeline and process group"
_LOGS = ("the run logs every metric to metrics.jsonl and the report_to backends",
         "logging_steps, report_to, or a grpo_engine.callbacks.Callback")
_TRACKIO = ("trackio logs locally here", "report_to=['trackio'] and trackio's own settings")

REFUSED: dict[str, tuple[str, str]] = {
    # -- TRL's own: model and reference ------------------------------------------------------------
    "trust_remote_code": ("models are loaded without remote code", "a model folder in transformers layout"),
    "router_aux_loss_coef": ("no mixture-of-experts auxiliary loss is added", "leave it unset"),
    "cast_lm_head_to_fp32": ("the lm_head pass is chunked in the compute dtype",
                             "bf16=False (float32 throughout)"),
    # -- data -------------------------------------------------------------------------------------
    "num_generations_eval": _NO_EVAL,
    "ds3_gather_for_generation": ("there is no DeepSpeed ZeRO-3 here", "MemoryPlan(sharding='fsdp')"),
    "shuffle_dataset": ("prompts are always drawn in a seeded shuffled order", "seed=N"),
    "pad_to_multiple_of": ("rows are padded to the batch's longest", "leave it 'auto'"),
    # -- generation -------------------------------------------------------------------------------
    "min_p": ("the sampler has temperature, top_p and top_k only", "top_p or top_k"),
    "generation_kwargs": ("the sampler has temperature, top_p and top_k only", "temperature, top_p, top_k"),
    "chat_template_kwargs": ("prompts are rendered with the plain chat template",
                             "a PromptTemplate on the native trainer (template=...)"),
    "repetition_penalty": ("the sampler has no repetition penalty", "leave it 1.0"),
    "cache_implementation": ("sampling uses its own KV cache", "leave it unset"),
    "use_transformers_continuous_batching": ("sampling uses grpo_engine's decoding loops",
                                             "leave it False"),
    "transformers_continuous_batching_config": ("sampling uses grpo_engine's decoding loops",
                                                "leave it unset"),
    "use_transformers_paged": ("sampling uses grpo_engine's decoding loops", "leave it False"),
    "vllm_structured_outputs_regex": ("the vLLM sampler has no structured outputs", "a format reward"),
    "vllm_server_timeout": ("the server sampler waits per request (VLLMServerSampler(timeout_s=600)), not "
                            "for the server to come up", "start the server before the run"),
    "vllm_group_port": ("weights reach the server through saved adapters or weights, not NCCL",
                        "leave it 51216"),
    "vllm_tensor_parallel_size": ("the colocated engine runs on one GPU",
                                  "vllm_mode='server' with a server started on several GPUs"),
    # -- logging ----------------------------------------------------------------------------------
    "log_multimodal": ("there is no multimodal logging", "leave it True"),
    "log_unique_prompts": ("log_completions writes every completion of the step",
                           "log_completions=True, then keep one row per prompt from completions.jsonl"),
    "log_completions_hub_repo": ("log_completions writes output_dir/completions.jsonl, not a hub dataset",
                                 "huggingface_hub.upload_file(path_or_fileobj='.../completions.jsonl', ...)"),
    "logging_first_step": ("the first step is logged when logging_steps divides it", "logging_steps=1"),
    "logging_nan_inf_filter": ("non-finite steps are skipped and counted (skipped_steps)", "leave it True"),
    "log_on_each_node": _LOGS, "include_num_input_tokens_seen": _LOGS, "log_level": _LOGS,
    "log_level_replica": _LOGS, "project": ("the backend's project is its own setting",
                                            "WANDB_PROJECT / TRACKIO_PROJECT in the environment"),
    "trackio_space_id": _TRACKIO, "trackio_bucket_id": _TRACKIO, "trackio_static_space_id": _TRACKIO,
    "skip_memory_metrics": _LOGS, "debug": _LOGS,
    # -- optimisation -----------------------------------------------------------------------------
    "optim_args": ("the optimizer is built from the config's AdamW settings", "adam_beta1/2, adam_epsilon"),
    "optim_target_modules": ("every trainable parameter is optimised", "a peft_config to train adapters"),
    "average_tokens_across_devices": ("the loss is always normalised by the whole step's counts",
                                      "leave it True"),
    "label_smoothing_factor": ("GRPO has no labels to smooth", "leave it 0.0"),
    "tf32": ("TF32 matmuls are torch's global setting", "torch.backends.cuda.matmul.allow_tf32 = True"),
    "bf16_full_eval": ("evaluation runs in the training precision", "bf16"),
    "fp16_full_eval": ("evaluation runs in the training precision", "fp16"),
    "gradient_checkpointing_kwargs": ("checkpointing is non-reentrant, per decoder layer",
                                      "gradient_checkpointing=True"),
    "activation_checkpointing_kwargs": ("checkpointing is non-reentrant, per decoder layer",
                                        "gradient_checkpointing=True"),
    "torch_compile_backend": ("the training pass compiles with inductor", "torch_compile=True"),
    "torch_compile_mode": ("the training pass compiles with inductor", "torch_compile=True"),
    "use_liger_kernel": ("the lm_head pass is chunked and tiled here (never [N, T, V] at once)",
                         "leave it False"),
    "liger_kernel_config": ("the lm_head pass is chunked and tiled here", "leave it unset"),
    "use_cache": ("the KV cache is always used for sampling and never for training", "leave it False"),
    "neftune_noise_alpha": ("no embedding noise is added", "leave it unset"),
    "torch_empty_cache_steps": ("the allocator's cache is left to torch", "leave it unset"),
    "auto_find_batch_size": ("a step's groups must stay whole", "per_device_train_batch_size"),
    "full_determinism": ("runs are seeded, not forced deterministic", "seed=N"),
    "data_seed": ("one seed orders prompts and seeds sampling", "seed=N"),
    # -- evaluation -------------------------------------------------------------------------------
    "eval_delay": _NO_EVAL, "prediction_loss_only": _NO_EVAL, "eval_on_start": _NO_EVAL,
    "eval_do_concat_batches": _NO_EVAL, "eval_use_gather_object": _NO_EVAL,
    "eval_accumulation_steps": _NO_EVAL, "include_for_metrics": _NO_EVAL, "batch_eval_metrics": _NO_EVAL,
    "load_best_model_at_end": ("checkpoints are kept by step, not by a metric", "save_total_limit=N"),
    "metric_for_best_model": ("checkpoints are kept by step, not by a metric", "save_total_limit=N"),
    "greater_is_better": ("checkpoints are kept by step, not by a metric", "save_total_limit=N"),
    "do_train": ("train() trains", "leave it False"),
    "do_predict": ("there is no prediction loop", "trainer.native.evaluate(prompts)"),
    # -- checkpoints and the hub ------------------------------------------------------------------
    "save_only_model": ("a checkpoint always holds what an exact resume needs", "save_strategy='no'"),
    "save_on_each_node": ("rank 0 writes every checkpoint", "leave it False"),
    "enable_jit_checkpoint": ("checkpoints are written every save_steps steps", "save_steps=N"),
    "ignore_data_skip": ("a resumed run continues the prompt stream exactly", "leave it False"),
    "restore_callback_states_from_checkpoint": ("callbacks' state is always restored on resume",
                                                "leave it False"),
    "resume_from_checkpoint": ("resuming is the train() argument, as in TRL's Trainer",
                               "trainer.train(resume_from_checkpoint=True)"),
    "hub_always_push": ("the hub layout is pushed at the end of train() and by save_model / push_to_hub",
                        "leave it False"),
    # -- launch and data loading ------------------------------------------------------------------
    "accelerator_config": ("there is no accelerate here; torchrun launches the processes",
                           "torchrun --nproc_per_node K script.py"),
    "parallelism_config": ("there is no accelerate here", "MemoryPlan(sharding='fsdp') under torchrun"),
    "fsdp": ("FSDP2 is the native MemoryPlan's sharding", "MemoryPlan(sharding='fsdp') under torchrun"),
    "fsdp_config": ("FSDP2 is the native MemoryPlan's sharding", "MemoryPlan(sharding='fsdp')"),
    "deepspeed": ("there is no DeepSpeed here", "MemoryPlan(sharding='fsdp') under torchrun"),
    "local_rank": ("torchrun's environment (RANK, LOCAL_RANK) says the rank", "leave it unset"),
    "ddp_backend": (_SPEED, "leave it unset (NCCL on GPUs, gloo on the CPU)"),
    "ddp_find_unused_parameters": (_SPEED, "leave it unset"), "ddp_bucket_cap_mb": (_SPEED, "leave it unset"),
    "ddp_broadcast_buffers": (_SPEED, "leave it unset"), "ddp_static_graph": (_SPEED, "leave it unset"),
    "ddp_timeout": (_SPEED, "leave it 1800"),
    "dataloader_drop_last": ("every step samples whole batches of prompts", "leave it False"),
    "dataloader_num_workers": (_SPEED, "leave it 0"), "dataloader_pin_memory": (_SPEED, "leave it True"),
    "dataloader_persistent_workers": (_SPEED, "leave it False"),
    "dataloader_prefetch_factor": (_SPEED, "leave it unset"),
    "dataloader_multiprocessing_context": (_SPEED, "leave it unset"),
    "dataloader_in_order": (_SPEED, "leave it unset"),
    "label_names": ("GRPO has no labels", "leave it unset"),
    "train_sampling_strategy": ("prompts are drawn in a seeded shuffled order", "leave it 'random'"),
    "length_column_name": ("prompts are not grouped by length", "leave it 'length'"),
}


def native_hint(owner: type, field: str) -> str | None:
    """The unknown-field message of the native ``GRPOConfig`` for one of TRL's fields: where it lives here,
    or why it has none and the nearest setting (None: not TRL's, or not the GRPOConfig)."""
    if owner.__name__ != "GRPOConfig":
        return None
    entry = "; or take TRL's fields as they are: from grpo_engine.trl import GRPOConfig, GRPOTrainer"
    if field in MAPPED:
        return f"TRL's {field} is {MAPPED[field]} here{entry}"
    if field in REFUSED:
        why, nearest = REFUSED[field]
        return f"TRL's {field} has no equivalent here ({why}); nearest: {nearest}"
    return None


UNKNOWN_FIELD_HINTS.append(native_hint)
