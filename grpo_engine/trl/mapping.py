"""TRL's GRPOConfig mapped onto the native records: :func:`native_run` turns a resolved
:class:`~grpo_engine.trl.config.GRPOConfig` into a :class:`NativeRun` (the native ``GRPOConfig``, the
``MemoryPlan``, the loss, the advantage, the learning-rate schedule and the evaluation period), or raises one
:class:`TRLSettingError` listing every field set to a value other than TRL's default that has no equivalent
here, each with why and the nearest setting.

- The batch: one optimizer step per generation batch (TRL's default, ``steps_per_generation ==
  gradient_accumulation_steps``): ``prompts_per_step = generation_batch_size / num_generations``, where
  ``generation_batch_size = per_device_train_batch_size x gradient_accumulation_steps x WORLD_SIZE``;
  ``micro_batch_size = per_device_train_batch_size``; ``num_iterations`` -> ``updates_per_batch``.
- Steps: TRL counts optimizer steps, ``num_iterations`` of them per generation batch; the native run counts
  batches, so ``max_steps``, ``logging_steps``, ``save_steps``, ``eval_steps`` and the warm-up become
  ceil(steps / num_iterations). ``max_steps=-1`` runs ``num_train_epochs`` over the dataset as TRL counts
  them: ceil(epochs x (len(dataset) // prompts_per_step) x num_iterations) optimizer steps.
- The loss (``loss_type``; TRL's clip ``epsilon`` / ``epsilon_high``, ``delta``, ``beta``: with
  ``use_bias_correction_kl`` the KL times the ratio, ``ClippedSurrogate(kl_ratio_weighted=True)``):
  grpo -> the per-sequence mean, dapo -> the token mean over the step, dr_grpo -> the token sum over N x
  max_completion_length, bnpo -> dapo's where one micro-batch is the whole step (else refused), cispo ->
  :class:`~grpo_engine.losses.cispo.CISPO` (TRL caps the weight at epsilon_high, here at 1 + clip_eps_high),
  ``importance_sampling_level="sequence"`` with grpo -> :class:`~grpo_engine.losses.gspo.GSPO`, sapo ->
  :class:`~grpo_engine.losses.sapo.SAPO` (``sapo_temperature_pos`` / ``_neg``), luspo -> at sequence level
  :class:`~grpo_engine.losses.luspo.LUSPO`, at token level the token sum over the completions, vespo ->
  :class:`~grpo_engine.losses.vespo.VESPO` (``vespo_k_pos`` ...). ``off_policy_mask_threshold`` ->
  ``ClippedSurrogate(off_policy_mask_threshold=...)``; ``entropy_coef`` ->
  ``ClippedSurrogate(entropy_coef=...)``, with ``use_adaptive_entropy`` an ``AdaptiveEntropyBonus`` term and
  callback (``entropy_coef_min`` ...), where TRL's per-micro-batch token mean is the loss's (dapo, one
  micro-batch a step; else refused).
- The advantage: ``scale_rewards`` -> ``GroupNormalized(std_scope=..., eps=1e-4)`` (TRL's 1e-4 on the std);
  ``multi_objective_aggregation="normalize_then_sum"`` -> ``WeightedSum(normalize="each", eps=1e-4)`` and
  ``ReinforcePlusPlusBaseline(eps=1e-4)`` (GDPO).
- The reference: ``sync_ref_model`` -> a ``ReferenceSync(every_steps=ref_model_sync_steps / num_iterations,
  alpha=ref_model_mixup_alpha)`` callback (full fine-tuning with beta > 0, as TRL requires).
- Precision: ``bf16`` -> ``MemoryPlan(compute_dtype="bfloat16")`` over float32 weights (TRL's default
  load); where TRL would refuse (no bf16 GPU and ``use_cpu=False``) the run computes in float32, with a note.
- vLLM (``use_vllm``): ``vllm_mode="colocate"`` -> :class:`~grpo_engine.sampling.vllm.VLLMSampler`
  (``vllm_gpu_memory_utilization``, ``vllm_enable_sleep_mode``, ``vllm_model_impl``), ``"server"`` ->
  :class:`~grpo_engine.sampling.vllm_server.VLLMServerSampler` at ``vllm_server_base_url`` (or host and
  port); ``vllm_importance_sampling_*`` -> ``ClippedSurrogate(tis_cap=..., tis_mode=..., tis_cap_min=...)``;
  ``vllm_max_model_length`` is the context the prompt limit is taken from.
- Prompts are never cut, as in TRL: ``max_prompt_tokens`` is the model's context less
  ``max_completion_length`` and a longer prompt stops the build, and sampling uses the dynamic decoding loop
  (a static cache would be sized for the whole context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from grpo_engine.advantages import GroupNormalized, ReinforcePlusPlusBaseline
from grpo_engine.config import GRPOConfig as NativeConfig
from grpo_engine.losses.adaptive_entropy import AdaptiveEntropyBonus
from grpo_engine.losses.cispo import CISPO
from grpo_engine.losses.clipped import ClippedSurrogate
from grpo_engine.losses.gspo import GSPO
from grpo_engine.losses.luspo import LUSPO
from grpo_engine.losses.sapo import SAPO
from grpo_engine.losses.vespo import VESPO
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.ref_sync import ReferenceSync
from grpo_engine.trl.errors import Problem, TRLSettingError, problem
from grpo_engine.trl.fields import TRL_FIELDS
from grpo_engine.trl.refused import REFUSED

__all__ = ["TRLSettingError", "NativeRun", "Schedule", "VLLMPlan", "native_run", "changed_fields",
           "problem"]

@dataclass(frozen=True)
class Schedule:
    """TRL's learning-rate schedule (``transformers.get_scheduler``), over the native run's steps."""

    name: str
    warmup_steps: int
    total_steps: int
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VLLMPlan:
    """TRL's ``use_vllm``: ``mode`` ``"colocate"`` (:class:`~grpo_engine.sampling.vllm.VLLMSampler`) or
    ``"server"`` (:class:`~grpo_engine.sampling.vllm_server.VLLMServerSampler`), and that sampler's own
    keyword arguments (the shared ones, token limits and sampling, come from the native config)."""

    mode: str
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NativeRun:
    """What a TRL config means here: the native records and components, and the notes to log.
    ``reward_normalize`` is the ``WeightedSum(normalize=...)`` of the rewards (``"each"``, with eps 1e-4,
    under TRL's ``normalize_then_sum``); ``callbacks`` join the trainer's (ReferenceSync, an adaptive
    entropy bonus: the loss term that is also a callback)."""

    config: NativeConfig
    memory: MemoryPlan
    loss: Any
    advantage: Any
    schedule: Schedule
    eval_every_steps: int | None
    reward_weights: list[float] | None
    notes: tuple[str, ...] = ()
    vllm: VLLMPlan | None = None
    reward_normalize: str = "after_sum"
    callbacks: tuple[Any, ...] = ()


def changed_fields(args: Any) -> set[str]:
    """The fields of ``args`` whose value differs from TRL's default, both as TRL resolves them (a value
    derived from other fields, such as ``generation_batch_size``, counts as changed)."""
    default = type(args)()
    return {name for name in TRL_FIELDS if getattr(args, name) != getattr(default, name)}


_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw8bit",
               "adamw_bnb_8bit": "adamw8bit", "paged_adamw_32bit": "paged_adamw",
               "paged_adamw_8bit": "paged_adamw8bit"}
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant",
              "constant_with_warmup": "constant"}
_EXACT_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                    "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")
_DTYPES = ("float32", "bfloat16", "float16")
_NO_OP_LOADING = {"revision": (None, "main"), "trust_remote_code": (False, None),
                  "attn_implementation": (None,)}


def native_run(args: Any, *, num_prompts: int | None, context_tokens: int | None, device_bf16: bool,
               lora: Any = None, quantization: Any = None, model_dtype: str | None = None,
               problems: list[Problem] | None = None) -> NativeRun:
    """The native run of ``args`` (a resolved TRL ``GRPOConfig``).

    Args:
        num_prompts: the training dataset's length (None for a stream: then ``max_steps`` must be set).
        context_tokens: the model's context (``max_position_embeddings``), or None when unknown.
        device_bf16: whether this machine computes in bfloat16 where TRL would (a bf16 GPU).
        lora: the trainer's ``peft_config`` (a peft ``LoraConfig``), or None.
        quantization: the trainer's ``quantization_config`` (a ``BitsAndBytesConfig``), or None.
        model_dtype: the dtype of a model object passed in (None for a name): TRL trains it in that dtype,
            and ``model_init_kwargs`` and ``quantization_config`` apply to a name only (TRL warns).
        problems: refusals found by the caller (the trainer's own arguments), reported with these.

    Raises:
        TRLSettingError: every setting with no equivalent here, at once.
    """
    found = list(problems or [])
    given = changed_fields(args)
    found += [problem(name, getattr(args, name), *REFUSED[name]) for name in sorted(given & REFUSED.keys())]
    mu = args.num_iterations
    prompts_per_step = args.generation_batch_size // args.num_generations
    found += _batch_problems(args, given)
    trl_steps = _trl_steps(args, num_prompts, prompts_per_step, found)
    epoch = max(1, num_prompts // prompts_per_step) if num_prompts is not None else None  # native steps
    steps = max(1, math.ceil(trl_steps / mu))
    memory, notes = _memory(args, device_bf16, lora, quantization, model_dtype, found)
    loss = _loss(args, found)
    callbacks = [t for t in getattr(loss, "terms", ()) if isinstance(t, AdaptiveEntropyBonus)]
    callbacks += _reference_sync(args, lora, found)
    gdpo = _aggregation(args, found, notes)
    vllm = _vllm(args, found, notes) if args.use_vllm else None
    if vllm is not None and args.vllm_max_model_length is not None:
        context_tokens = args.vllm_max_model_length  # TRL's context for vLLM: prompt and completion
    if context_tokens is not None and (args.max_completion_length or 0) >= context_tokens:
        found.append(problem("max_completion_length", args.max_completion_length, f"the model's context is "
                             f"{context_tokens} tokens, which leaves no room for a prompt",
                             f"max_completion_length below {context_tokens}"))
    native = dict(
        prompts_per_step=prompts_per_step, group_size=args.num_generations, updates_per_batch=mu,
        max_completion_tokens=args.max_completion_length or 1, max_steps=steps,
        max_prompt_tokens=max(1, (context_tokens or 4096) - (args.max_completion_length or 0)),
        overlong_prompts="error", temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        learning_rate=args.learning_rate, lr_schedule=_SCHEDULES.get(str(args.lr_scheduler_type), "constant"),
        weight_decay=args.weight_decay, adam_betas=(args.adam_beta1, args.adam_beta2),
        adam_eps=args.adam_epsilon, max_grad_norm=args.max_grad_norm or None, seed=args.seed,
        output_dir=args.output_dir, progress_bar=not args.disable_tqdm,
        log_every_steps=_period(args, "logging", trl_steps, mu, epoch, found) or steps + 1,
        save_every_steps=_period(args, "save", trl_steps, mu, epoch, found),
        keep_last_checkpoints=args.save_total_limit or None, report_to=_report_to(args, found),
        max_turns=(args.max_tool_calling_iterations + 1 if args.max_tool_calling_iterations is not None
                   else max(2, args.max_completion_length or 2)))
    schedule = _schedule(args, steps, trl_steps, mu, found)
    native["warmup_steps"] = schedule.warmup_steps if native["lr_schedule"] != "constant" else 0
    eval_every = _period(args, "eval", trl_steps, mu, epoch, found)
    if str(args.hub_strategy) not in ("every_save", "end"):
        found.append(problem("hub_strategy", str(args.hub_strategy), "checkpoints are not pushed: the hub "
                             "layout is pushed at the end of train() and by save_model / push_to_hub",
                             "hub_strategy='end'"))
    if found:
        raise TRLSettingError(found)
    scale = {"group": "group", "batch": "batch", "none": "none"}[args.scale_rewards]
    advantage = ReinforcePlusPlusBaseline(eps=1e-4) if gdpo else GroupNormalized(std_scope=scale, eps=1e-4)
    return NativeRun(config=NativeConfig(**native), memory=memory, loss=loss, advantage=advantage,
                     schedule=schedule, eval_every_steps=eval_every, reward_weights=args.reward_weights,
                     notes=tuple(notes), vllm=vllm, reward_normalize="each" if gdpo else "after_sum",
                     callbacks=tuple(callbacks))


def _aggregation(args: Any, found: list[Problem], notes: list[str]) -> bool:
    """TRL's ``multi_objective_aggregation``: ``"sum_then_normalize"`` (False: the weighted sum, then
    ``scale_rewards``' GroupNormalized) or ``"normalize_then_sum"`` (True: GDPO, each reward z-scored in its
    group with eps 1e-4, ``WeightedSum(normalize="each", eps=1e-4)``, the sum whitened over the step,
    ``ReinforcePlusPlusBaseline(eps=1e-4)``; TRL ignores ``scale_rewards`` there too)."""
    kind = args.multi_objective_aggregation
    if kind not in ("sum_then_normalize", "normalize_then_sum"):
        found.append(problem("multi_objective_aggregation", kind, "not one of TRL's 'sum_then_normalize', "
                             "'normalize_then_sum'", "'sum_then_normalize' (TRL's default)"))
        return False
    if kind == "normalize_then_sum":
        notes.append("multi_objective_aggregation='normalize_then_sum': a reward function that returns None "
                     "for some completions stops the run here (TRL leaves them out of that reward's group "
                     "mean and std)")
    return kind == "normalize_then_sum"


def _reference_sync(args: Any, lora: Any, found: list[Problem]) -> list[ReferenceSync]:
    """TRL's ``sync_ref_model`` (TR-DPO): ``ReferenceSync(every_steps=ref_model_sync_steps / num_iterations,
    alpha=ref_model_mixup_alpha)``, TRL's sync after every tau optimizer steps; full fine-tuning with a KL, as
    in TRL, which refuses the others too."""
    if not args.sync_ref_model:
        return []
    tau, mu, alpha = args.ref_model_sync_steps, args.num_iterations, args.ref_model_mixup_alpha
    if not args.beta:
        refusal = ("sync_ref_model", True, "beta=0.0 uses no reference policy, so there is nothing to sync "
                   "(TRL refuses it too)", "beta > 0 (e.g. 0.04), or sync_ref_model=False")
    elif lora is not None:
        refusal = ("sync_ref_model", True, "under peft_config the reference is the base model with the "
                   "adapter off, not a copy to move (TRL refuses it too)",
                   "full fine-tuning (no peft_config), or sync_ref_model=False")
    elif not 0 < alpha <= 1:
        refusal = ("ref_model_mixup_alpha", alpha, "the policy's weight in the mix lies in (0, 1] (1 copies "
                   "it)", "ref_model_mixup_alpha=0.6 (TRL's default)")
    elif tau < 1 or tau % mu:
        refusal = ("ref_model_sync_steps", tau, f"TRL syncs after every {tau} optimizer steps, here at the "
                   f"end of a generation batch of num_iterations={mu} updates",
                   f"ref_model_sync_steps a positive multiple of {mu}")
    else:
        return [ReferenceSync(every_steps=tau // mu, alpha=alpha)]
    found.append(problem(*refusal))
    return []


def _vllm(args: Any, found: list[Problem], notes: list[str]) -> VLLMPlan | None:
    """TRL's vLLM settings as the native vLLM sampler's."""
    if args.vllm_mode == "server":
        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        notes.append(f"vllm_mode='server': the sampler drives the vLLM server at {url}, started with "
                     "grpo_engine.sampling.vllm_server.server_command() (docs/vllm.md), not `trl vllm-serve`")
        return VLLMPlan("server", {"base_url": url})
    if args.vllm_mode != "colocate":
        found.append(problem("vllm_mode", args.vllm_mode, "not one of TRL's 'colocate', 'server'",
                             "vllm_mode='colocate'"))
        return None
    engine = {"model_impl": args.vllm_model_impl} if args.vllm_model_impl != "vllm" else {}
    return VLLMPlan("colocate", {"gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                                 "sleep_between_steps": bool(args.vllm_enable_sleep_mode),
                                 "engine_kwargs": engine})


def _batch_problems(args: Any, given: set[str]) -> list[Problem]:
    found = []
    if args.steps_per_generation != args.gradient_accumulation_steps:
        name = "generation_batch_size" if "generation_batch_size" in given else "steps_per_generation"
        whole = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        why = (f"a generation batch of {args.generation_batch_size} completions spread over "
               f"{args.steps_per_generation} / {args.gradient_accumulation_steps} optimizer steps; here each "
               "generation batch is one optimizer step (prompts_per_step x group_size completions, "
               "num_iterations updates on it)")
        found.append(problem(name, getattr(args, name), why, f"leave it unset (the generation batch is then "
                             "per_device_train_batch_size x gradient_accumulation_steps x WORLD_SIZE = "
                             f"{whole}), "
                             f"or set gradient_accumulation_steps={args.steps_per_generation}"))
    prompts = args.generation_batch_size // args.num_generations
    if args.world_size > 1 and prompts % args.world_size:
        found.append(problem("per_device_train_batch_size", args.per_device_train_batch_size,
                             f"{prompts} prompt(s) a step across {args.world_size} processes: TRL spreads a "
                             "group's completions over the processes, here each process samples whole groups",
                             "per_device_train_batch_size x gradient_accumulation_steps a multiple of "
                             f"num_generations={args.num_generations}"))
    if args.max_completion_length is None:
        found.append(problem("max_completion_length", None, "every completion needs a token limit here",
                             "max_completion_length=512 (TRL's default)"))
    if args.scale_rewards not in ("group", "batch", "none"):
        found.append(problem("scale_rewards", args.scale_rewards, "not one of TRL's 'group', 'batch', 'none'",
                             "scale_rewards='group'"))
    return found


def _trl_steps(args: Any, num_prompts: int | None, prompts_per_step: int, found: list[Problem]) -> int:
    """TRL's optimizer steps: ``max_steps``, or ``num_train_epochs`` over the dataset as TRL counts them."""
    if args.max_steps > 0:
        return int(args.max_steps)
    if num_prompts is None:
        found.append(problem("max_steps", args.max_steps, "max_steps=-1 runs num_train_epochs over the "
                             "dataset, and this dataset has no length (a stream)", "max_steps=N"))
        return 1
    batches = num_prompts // prompts_per_step
    if batches == 0:
        found.append(problem("max_steps", args.max_steps, f"the dataset's {num_prompts} prompts do not "
                             f"fill one generation batch of {prompts_per_step} prompts: an epoch has no step",
                             "more prompts, a smaller per_device_train_batch_size, or max_steps=N"))
        return 1
    return math.ceil(args.num_train_epochs * batches * args.num_iterations)


def _every(args: Any, name: str, trl_steps: int, mu: int, found: list[Problem]) -> int:
    """A period in TRL's optimizer steps (a float below 1: a fraction of the run) as native steps."""
    value = getattr(args, name)
    if value is None or value <= 0:
        found.append(problem(name, value, "a period must be a positive number of steps", f"{name}=10"))
        return 1
    steps = math.ceil(trl_steps * value) if value < 1 else int(value)
    return max(1, math.ceil(steps / mu))


def _period(args: Any, kind: str, trl_steps: int, mu: int, epoch: int | None, found: list[Problem]
            ) -> int | None:
    """``{kind}_strategy`` (``logging``, ``save``, ``eval``) as native steps: ``"steps"`` every
    ``{kind}_steps``, ``"epoch"`` every epoch's batches, ``"no"`` None."""
    strategy = str(getattr(args, f"{kind}_strategy"))
    if strategy == "no":
        return None
    if strategy == "epoch" and epoch is not None:
        return epoch
    if strategy != "steps":
        why = ("an epoch has no length here: the dataset is a stream" if strategy == "epoch" else
               "checkpoints are kept by step here, not by a metric")
        found.append(problem(f"{kind}_strategy", strategy, why, f"{kind}_strategy='steps', {kind}_steps=N"))
        return None
    return _every(args, f"{kind}_steps", trl_steps, mu, found)


def _report_to(args: Any, found: list[Problem]) -> list[str]:
    known = ("tensorboard", "wandb", "trackio")
    other = [name for name in args.report_to if name not in known]
    if other:
        found.append(problem("report_to", args.report_to, f"no logging backend {other} here "
                             "(metrics.jsonl is always written)", f"report_to among {list(known)}"))
    return [name for name in args.report_to if name in known]


def _schedule(args: Any, steps: int, trl_steps: int, mu: int, found: list[Problem]) -> Schedule:
    name = str(args.lr_scheduler_type)
    if name not in _EXACT_SCHEDULES:
        found.append(problem("lr_scheduler_type", name, "it reads an evaluation metric or a search "
                             "the run here does not have", "lr_scheduler_type='linear' (TRL's default)"))
    warmup = args.warmup_steps
    warmup = int(warmup) if warmup >= 1 else math.ceil(trl_steps * warmup)
    return Schedule(name=name, warmup_steps=math.ceil(warmup / mu), total_steps=steps,
                    kwargs=dict(args.lr_scheduler_kwargs or {}))


def _memory(args: Any, device_bf16: bool, lora: Any, quantization: Any, model_dtype: str | None,
            found: list[Problem]) -> tuple[MemoryPlan, list[str]]:
    notes: list[str] = []
    if model_dtype is not None:  # a model object: TRL ignores the loading settings, with a warning
        ignored = [name for name, value in (("model_init_kwargs", args.model_init_kwargs),
                                            ("quantization_config", quantization)) if value is not None]
        notes += [f"{name} is ignored: the model is already built (as TRL does)" for name in ignored]
        quantization = None
    dtype = model_dtype or _model_dtype(args, found)
    if dtype not in _DTYPES:
        found.append(problem("model", dtype, "a model object's weights train in float32, bfloat16 or "
                             "float16 here", "the model in one of them, or its name"))
        dtype = "float32"
    compute = "float16" if args.fp16 else "bfloat16" if args.bf16 else None
    if compute == "bfloat16" and not (device_bf16 or args.use_cpu):
        notes.append("bf16=True (TRL's default when fp16 is off): TRL refuses it on a machine without a bf16 "
                     "GPU unless use_cpu=True (then it computes in bf16 on the CPU); this run computes in "
                     "float32. Pass bf16=False to silence this, or use_cpu=True for TRL's bf16 on the CPU")
        compute = None
    if dtype != "float32":
        compute = None  # half weights compute in their own dtype, as TRL's autocast does on them
    optimizer = _OPTIMIZERS.get(str(args.optim))
    if optimizer is None:
        found.append(problem("optim", str(args.optim), "not an AdamW this trainer builds",
                             f"optim among {sorted(_OPTIMIZERS)}"))
    settings = dict(gradient_checkpointing=bool(args.gradient_checkpointing), dtype=dtype,
                    compute_dtype=compute, micro_batch_size=args.per_device_train_batch_size,
                    optimizer=optimizer or "adamw",
                    decoding="dynamic", compile_training=bool(args.torch_compile))
    settings.update(_four_bit(quantization, lora, found, notes))
    try:
        return MemoryPlan(**settings, lora=lora), notes
    except ValueError as error:  # a LoraConfig setting LoRA cannot honour (ConfigError is a ValueError)
        found.append(problem("peft_config", type(lora).__name__, str(error).replace("\n", " "),
                             "a LoraConfig with r, lora_alpha, lora_dropout, target_modules"))
        return MemoryPlan(**settings), notes


def _four_bit(quantization: Any, lora: Any, found: list[Problem], notes: list[str]) -> dict[str, Any]:
    """A ``BitsAndBytesConfig`` of a 4-bit NF4 base under a ``peft_config``: QLoRA, the base in 4 bits and
    the compute in ``bnb_4bit_compute_dtype``; anything else is refused."""
    if quantization is None:
        return {}
    four = getattr(quantization, "load_in_4bit", False)
    kind = getattr(quantization, "bnb_4bit_quant_type", None)
    compute = str(getattr(quantization, "bnb_4bit_compute_dtype", None) or "float32").removeprefix("torch.")
    if not (four and kind == "nf4" and lora is not None and compute in _DTYPES):
        found.append(problem("quantization_config", type(quantization).__name__, "a 4-bit base here is NF4 "
                             f"under LoRA (QLoRA); got load_in_4bit={four}, bnb_4bit_quant_type={kind!r}, "
                             f"peft_config {'set' if lora is not None else 'None'}",
                             "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4') with a "
                             "peft_config"))
        return {}
    if not getattr(quantization, "bnb_4bit_use_double_quant", False):
        notes.append("quantization_config: the 4-bit base is quantised twice here (its scales too, "
                     "bnb_4bit_use_double_quant=True), which this config leaves off: ~0.4 bits a weight less")
    return {"quantization": "nf4", "dtype": compute, "compute_dtype": None}


def _model_dtype(args: Any, found: list[Problem]) -> str:
    """``model_init_kwargs={"dtype": ...}`` (TRL loads float32 by default); the keys TRL's own script sets
    at their no-op values (``revision="main"``, ``trust_remote_code=False``, ``attn_implementation=None``)
    pass; other keys are refused."""
    kwargs = dict(args.model_init_kwargs or {})
    for key, no_op in _NO_OP_LOADING.items():
        if key in kwargs and kwargs[key] in no_op:
            del kwargs[key]
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None)) or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if kwargs or dtype not in _DTYPES:
        found.append(problem("model_init_kwargs", args.model_init_kwargs, "only the weights' dtype "
                             f"({', '.join(_DTYPES)}) carries over when the model is loaded here",
                             "model_init_kwargs={'dtype': 'bfloat16'}, or load the model yourself and pass "
                             "it"))
        return "float32"
    return dtype


def _loss(args: Any, found: list[Problem]) -> Any:
    """The loss of ``loss_type`` with TRL's clip, δ and KL."""
    kind, level, beta = args.loss_type, args.importance_sampling_level, args.beta
    low, high = args.epsilon, args.epsilon_high
    weighted_kl = bool(beta) and bool(args.use_bias_correction_kl)
    tis = _importance_sampling(args, found)
    if weighted_kl and (level == "sequence" or kind in ("cispo", "sapo", "vespo")):
        found.append(problem("beta", beta, "with use_bias_correction_kl=True (TRL's default) TRL multiplies "
                             "each token's KL by the ratio, which GSPO, CISPO, SAPO, VESPO here do not",
                             "use_bias_correction_kl=False (the k3 KL of GRPO), or beta=0.0 (TRL's default)"))
    if level == "sequence":
        if kind not in ("grpo", "luspo"):
            found.append(problem("importance_sampling_level", level, f"a sequence-level ratio with "
                                 f"loss_type={kind!r} weights each sequence by its length in TRL; GSPO here "
                                 "is the per-sequence mean",
                                 "loss_type='grpo' with importance_sampling_level='sequence' (GSPO)"))
        found += _unsupported_terms(args, "LUSPO" if kind == "luspo" else "GSPO", tis)
        if kind == "luspo":
            return LUSPO(clip_eps_low=low, clip_eps_high=high, kl_coef=beta)
        return GSPO(clip_eps_low=low, clip_eps_high=high, kl_coef=beta)
    if level != "token":
        found.append(problem("importance_sampling_level", level, "not 'token' or 'sequence'", "'token'"))
    if kind == "cispo":
        if high < 1:
            found.append(problem("epsilon_high", high, "loss_type='cispo' caps the IS weight at epsilon_high "
                                 "in TRL, and CISPO here at 1 + clip_eps_high, so a cap below 1 has no "
                                 "equivalent", "epsilon_high=5.0 (ScaleRL's)"))
            return None
        found += _unsupported_terms(args, "CISPO", tis)
        return CISPO(clip_eps_high=high - 1, kl_coef=beta)
    if kind == "vespo":  # vLLM's token ratio is folded into the sequence ratio, as TRL does
        if tis and not tis["tis_mode"].startswith("token"):
            found.append(problem("vllm_importance_sampling_mode", tis["tis_mode"], "loss_type='vespo' folds "
                                 "the sampler's token ratio into its sequence ratio (TRL refuses it too)",
                                 "vllm_importance_sampling_mode='token_truncate' or 'token_mask'"))
            tis = {}
        found += _unsupported_terms(args, "VESPO", {})
        if tis.pop("tis_cap_min", None) is not None:
            found.append(problem("vllm_importance_sampling_clip_min", args.vllm_importance_sampling_clip_min,
                                 "VESPO here caps the sampler's ratio from above only",
                                 "vllm_importance_sampling_clip_min=None (TRL's default)"))
        return VESPO(k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
                     lambda_neg=args.vespo_lambda_neg, kl_coef=beta, **tis)
    if kind == "sapo":
        found += _unsupported_terms(args, "SAPO", tis)
        return SAPO(temperature_pos=args.sapo_temperature_pos, temperature_neg=args.sapo_temperature_neg,
                    kl_coef=beta)
    one_batch = args.steps_per_generation == 1 and args.world_size == 1
    # luspo at token level: each completion's token sum, mean over completions (a constant of 1 token)
    aggregation = {"grpo": "sequence", "dapo": "token", "dr_grpo": "constant", "luspo": "constant"}.get(kind)
    if kind == "bnpo" and one_batch:
        aggregation = "token"  # one micro-batch per step: the local batch is the whole step
    if aggregation is None:
        found.append(problem("loss_type", kind, _LOSS_WHY.get(kind, "not a TRL loss_type"),
                             "loss_type='dapo' (TRL's default: the token mean over the step)"))
        return None
    if args.mask_truncated_completions and aggregation in ("sequence", "constant"):
        found.append(problem("mask_truncated_completions", True, f"with loss_type={kind!r} TRL still counts "
                             "a masked completion in the rows it divides by; here a masked completion leaves "
                             "the step's counts", "loss_type='dapo' (the same in both: masked tokens leave "
                             "the token count)"))
    threshold = args.off_policy_mask_threshold
    if threshold is not None and not threshold >= 0:
        found.append(problem("off_policy_mask_threshold", threshold, "the mask's threshold is a mean "
                             "log-ratio >= 0 here", "off_policy_mask_threshold=0.5, or None (off)"))
        threshold = None
    return ClippedSurrogate(clip_eps_low=low, clip_eps_high=high, kl_coef=beta, kl_ratio_weighted=weighted_kl,
                            aggregation=aggregation,
                            max_completion_tokens={"dr_grpo": args.max_completion_length,
                                                   "luspo": 1}.get(kind),
                            delta=args.delta, mask_truncated=bool(args.mask_truncated_completions),
                            top_entropy_quantile=(args.top_entropy_quantile if args.top_entropy_quantile < 1
                                                  else None), off_policy_mask_threshold=threshold,
                            **_entropy(args, aggregation, found), **tis)


def _entropy(args: Any, aggregation: str, found: list[Problem]) -> dict[str, Any]:
    """TRL's entropy bonus, ``entropy_coef`` times each micro-batch's token-mean entropy:
    ``ClippedSurrogate(entropy_coef=...)``, or under ``use_adaptive_entropy`` an
    :class:`~grpo_engine.losses.adaptive_entropy.AdaptiveEntropyBonus` term (also the run's callback),
    where that mean is the loss's (the token mean over a step of one micro-batch)."""
    adaptive = bool(args.use_adaptive_entropy)
    if not (adaptive or args.entropy_coef):
        return {}
    name = "use_adaptive_entropy" if adaptive else "entropy_coef"
    refusal = _entropy_refusal(args, aggregation, adaptive)
    if refusal is None and not adaptive:
        return {"entropy_coef": args.entropy_coef}
    if refusal is None:
        try:
            return {"terms": (AdaptiveEntropyBonus(
                entropy_target=args.entropy_target, coef=args.entropy_coef, delta=args.entropy_coef_delta,
                coef_min=args.entropy_coef_min, coef_max=args.entropy_coef_max),)}
        except ValueError as error:
            refusal = (str(error), "entropy_coef_min <= entropy_coef <= entropy_coef_max, "
                                   "entropy_coef_delta > 0")
    found.append(problem(name, getattr(args, name), *refusal))
    return {}


def _entropy_refusal(args: Any, aggregation: str, adaptive: bool) -> tuple[str, str] | None:
    """Why TRL's entropy bonus has no equal here in this setting, and the nearest (None: it has)."""
    if aggregation != "token":
        return (f"TRL adds the token mean of the entropy; with loss_type={args.loss_type!r} the bonus here "
                "is aggregated as the policy term (per sequence, or over N x max_completion_length)",
                "loss_type='dapo' (TRL's default: both are the token mean)")
    if args.gradient_accumulation_steps > 1 or args.world_size > 1:
        return ("TRL adds each micro-batch's own token mean (over gradient_accumulation_steps micro-batches "
                "and the processes), here the step's token mean: the same for one micro-batch a step",
                "gradient_accumulation_steps=1 on one process (a larger per_device_train_batch_size)")
    if args.top_entropy_quantile < 1:
        return ("with top_entropy_quantile < 1 TRL's bonus acts on the high-entropy tokens only, here on "
                "every token", "top_entropy_quantile=1.0")
    if adaptive and args.num_iterations > 1:
        return ("TRL moves the coefficient after each of the num_iterations updates on a generation batch, "
                "here once a batch", "num_iterations=1")
    if not adaptive and args.entropy_coef < 0:
        return ("the bonus's coefficient is >= 0 here (a negative one penalises entropy)", "entropy_coef > 0")
    return None


def _importance_sampling(args: Any, found: list[Problem]) -> dict[str, Any]:
    """TRL's correction of vLLM's log-probs: ``ClippedSurrogate(tis_cap=..., tis_mode=...)``."""
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return {}
    if args.vllm_importance_sampling_clip_max is None and args.vllm_importance_sampling_clip_min is None:
        found.append(problem("vllm_importance_sampling_clip_max", None, "the correction here always has a "
                             "bound (TRL's mask modes then weigh by the raw ratio)",
                             "vllm_importance_sampling_clip_max=3.0 (TRL's default)"))
        return {}
    low = args.vllm_importance_sampling_clip_min
    if low is not None and low < 0:
        found.append(problem("vllm_importance_sampling_clip_min", low, "a ratio is never negative: the lower "
                             "bound is >= 0 here", "vllm_importance_sampling_clip_min=None or 0.5"))
        low = None
    return {"tis_cap": args.vllm_importance_sampling_clip_max, "tis_mode": args.vllm_importance_sampling_mode,
            "tis_cap_min": low}


def _unsupported_terms(args: Any, loss: str, tis: dict[str, Any]) -> list[Problem]:
    """The ClippedSurrogate terms a GSPO / CISPO loss does not take."""
    terms = {"mask_truncated_completions": args.mask_truncated_completions,
             "top_entropy_quantile": args.top_entropy_quantile < 1, "delta": args.delta is not None,
             "vllm_importance_sampling_correction": bool(tis),
             "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
             "use_adaptive_entropy": args.use_adaptive_entropy,
             "entropy_coef": bool(args.entropy_coef) and not args.use_adaptive_entropy}
    token_mean = ("use_adaptive_entropy", "entropy_coef")  # TRL's bonus is the token mean: dapo's here
    return [problem(name, getattr(args, name), f"{loss} here has no such term",
                    "loss_type='dapo'" if name in token_mean else "loss_type='dapo' or 'grpo'")
            for name, used in terms.items() if used]


_LOSS_WHY = {
    "bnpo": "bnpo normalises each micro-batch by its own tokens, which differs from the step's token mean "
            "when a step has several micro-batches (gradient_accumulation_steps > 1 or several processes)",
}
