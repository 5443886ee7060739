"""VLLMServerSampler: the Sampler protocol on a ``vllm serve`` server the user started (its OpenAI API).

For a second GPU (or machine) that only generates. The trainer's process needs no vLLM: it talks HTTP
to the server (``/v1/completions``), sends each prompt as token ids (never text to re-tokenise) with
``n=G``, a seed per prompt and ``logprobs=0``, and reads back the sampled ids (``return_token_ids``)
with their log-probs. Weight sync, whenever the policy's trainable parameters changed:

- LoRA, ``lora_sync="adapter"``: the adapter is saved to ``sync_dir`` and loaded by the server at run
  time (``/v1/load_lora_adapter``; the server needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and
  ``--enable-lora``); the previous one is unloaded.
- Full fine-tuning, or LoRA with ``lora_sync="merged"``: the weights are saved to ``sync_dir`` as
  safetensors and reloaded in place (``/collective_rpc`` ``reload_weights``, then
  ``/reset_prefix_cache``; the server needs ``VLLM_SERVER_DEV_MODE=1``).

Under ``torchrun`` the ranks share one server, each sampling its share of the step's prompts (seeds keyed
by the prompt's place in the whole step, so K ranks draw what one process draws). A sync changes what
every rank samples with, so rank 0 alone makes it (saves, loads, unloads, reloads) while the others wait
for it (a broadcast of its outcome: its error is raised on every rank), and every rank then names the
same adapter: ``<run>-<n>``, the run named by rank 0's ``sync_dir`` (several runs share a server without
taking each other's adapters). The old adapter is unloaded at the next sync, when every rank's requests
with it have ended (the step's gradients were summed between).

``sync_dir`` must be a folder the server reads under the same path: on one machine the default (a
folder in ``/dev/shm``) is; across machines, a shared filesystem. :func:`server_command` gives the
command that starts a matching server (prefix caching on).

Multi-turn (``generate_turn``, what :class:`~grpo_engine.tools.rollout.ToolSampler` calls): one request
per row, ``n=1``, its whole context as token ids, so the server's prefix cache serves what the earlier
turns computed; the sync runs at a step's first turn (:mod:`~grpo_engine.sampling.vllm_turns`).
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_engine.sampling.turns import Turn
from grpo_engine.sampling.vllm import SyncedSampler, _save_adapter
from grpo_engine.sampling.vllm_turns import as_turn, turn_requests
from grpo_engine.types import Draws, Prompt, RolloutBatch
from grpo_engine.world import World

__all__ = ["VLLMServerSampler", "server_command"]

_HINTS = {  # what a 404 from each endpoint means: the server was started without it
    "/v1/load_lora_adapter": "start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment "
                             "and --enable-lora --max-lora-rank R (server_command() gives the command)",
    "/collective_rpc": "weights are reloaded through vLLM's development endpoints: start the server with "
                       "VLLM_SERVER_DEV_MODE=1 in its environment (server_command(full_weights=True))",
    "/reset_prefix_cache": "start the server with VLLM_SERVER_DEV_MODE=1 in its environment",
}


def server_command(model: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
                   max_model_len: int = 2048, dtype: str = "auto", max_lora_rank: int | None = 64,
                   full_weights: bool = False, python: str = sys.executable,
                   extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment variables that start a vLLM server this sampler can drive.

    ``max_lora_rank``: serve LoRA adapters up to that rank (``None``: no LoRA). ``full_weights``: enable
    the development endpoints through which full fine-tuning (or ``lora_sync="merged"``) reloads weights;
    they let any client reload weights from the server's disk, so bind to 127.0.0.1 or a private network.
    Log-probs are served after the temperature (``--logprobs-mode processed_logprobs``), the quantity the
    trainer computes; prefix caching is on (a multi-turn rollout's next turn reuses the context's KV).
    ``extra``: more ``vllm serve`` arguments (``--enforce-eager``...).

    Example:
        >>> argv, env = server_command("path/to/model", port=8001, max_lora_rank=16, python="python")
        >>> " ".join(argv[:3]), env
        ('python -m vllm.entrypoints.openai.api_server', {'VLLM_ALLOW_RUNTIME_LORA_UPDATING': 'True'})
    """
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", host,
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--logprobs-mode", "processed_logprobs", "--served-model-name", "policy",
            "--enable-prefix-caching"]
    env: dict[str, str] = {}
    if max_lora_rank is not None:
        argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if full_weights:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return argv + list(extra), env


class VLLMServerSampler(SyncedSampler):
    """Samples with a vLLM server started by the user (see the module docstring); the Sampler protocol.

    Args:
        model: the policy being trained (a peft model under LoRA): its weights are synced to the server.
        tokenizer: its tokenizer (the server's model must use the same ids).
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        served_model: the server's name for the base model (default: the first it lists).
        lora_sync: ``"adapter"`` (the adapter loaded at run time) or ``"merged"`` (merged into a float32
            copy of the base weights, which the server reloads in place). Full fine-tuning reloads weights.
        sync_dir: a folder the server reads under the same path (default: one in /dev/shm, else /tmp).
        timeout_s: the longest one HTTP request may take (a step's generation included).
        api_key: the server's ``--api-key``, if it has one.
        template, max_prompt_tokens, max_completion_tokens, temperature, top_p, top_k: as
            :class:`~grpo_engine.sampling.hf.HFSampler`.

    Example:
        >>> # sampler = VLLMServerSampler(model, tokenizer, base_url="http://127.0.0.1:8000")
        >>> # trainer = GRPOTrainer(model, rewards, prompts, config, tokenizer=tokenizer, sampler=sampler)
    """

    _ENGINE_ARGUMENTS = "vLLM's own arguments go on the server's command line (server_command())"

    def __init__(self, model: nn.Module, tokenizer: Any, *, base_url: str, served_model: str | None = None,
                 lora_sync: str = "adapter", sync_dir: str | Path | None = None, timeout_s: float = 600.0,
                 api_key: str | None = None, **settings: Any) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} must be the server's http(s) address, e.g. "
                             "'http://127.0.0.1:8000'")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0: the longest one request may take")
        super().__init__(model, tokenizer, lora_sync=lora_sync, sync_dir=sync_dir, **settings)
        self.base_url, self.served_model = base_url.rstrip("/"), served_model
        self.timeout_s, self.api_key = timeout_s, api_key
        self.started, self._adapter_id, self._adapter_name = False, 0, None
        self.world, self._run = World(), self.sync_dir.name  # the launch's, read at the first sample()

    # -- HTTP ------------------------------------------------------------------------------------

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET (no body) or POST ``body`` as JSON; the answer decoded (JSON) or as text (anything else)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                text = answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            hint = f"; {_HINTS[path]}" if exc.code == 404 and path in _HINTS else ""
            raise RuntimeError(f"the vLLM server at {self.base_url} answered {path} with HTTP {exc.code}: "
                               f"{detail}{hint}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConnectionError(f"no vLLM server answered at {self.base_url}{path} ({reason}); start one "
                                  "(grpo_engine.sampling.vllm_server.server_command() gives the command) "
                                  "or fix base_url") from None
        if answer.headers.get_content_type() != "application/json":
            return text.decode(errors="replace")  # e.g. "Success: LoRA adapter ... added"
        return json.loads(text)

    def _start(self) -> None:
        """Checks the server: it serves the model, long enough for a prompt and its completion, and (where
        its development endpoints tell) it returns log-probs after the temperature."""
        self.lora = getattr(self.model, "peft_config", None) is not None
        served = {m["id"]: m for m in self._request("/v1/models")["data"]}
        self.served_model = self.served_model or next(iter(served))
        if self.served_model not in served:
            raise ValueError(f"served_model={self.served_model!r} is not served at {self.base_url}; it "
                             f"serves {sorted(served)}")
        need = self.max_prompt_tokens + self.max_completion_tokens
        length = served[self.served_model].get("max_model_len")
        if length is not None and length < need:
            raise ValueError(f"the server's max_model_len={length} is shorter than max_prompt_tokens + "
                             f"max_completion_tokens = {need}; restart it with --max-model-len {need}")
        try:
            info = self._request("/server_info?config_format=json")
        except RuntimeError:  # no development endpoints: the mode cannot be read
            warnings.warn(f"cannot read the logprobs mode of the server at {self.base_url} (it has no "
                          "VLLM_SERVER_DEV_MODE=1); it must run with --logprobs-mode processed_logprobs, "
                          "else its log-probs ignore the temperature (mismatch/logprob_abs shows it)",
                          stacklevel=3)
        else:
            mode = info["vllm_config"]["model_config"].get("logprobs_mode")
            if mode != "processed_logprobs":
                raise ValueError(f"the server at {self.base_url} returns {mode} log-probs; restart it with "
                                 "--logprobs-mode processed_logprobs (after the temperature, the trainer's "
                                 "quantity)")
        self.world = World.current()  # under torchrun: the ranks share this server
        self._run = self.world.broadcast(self._run)  # adapters named for rank 0's run
        self.started = True

    # -- weight sync -----------------------------------------------------------------------------

    def _sync_adapter(self) -> None:
        self._adapter_id += 1
        name, folder = f"{self._run}-{self._adapter_id}", self.sync_dir / f"adapter-{self._adapter_id}"
        old = self._adapter_name

        def load() -> None:
            _save_adapter(self.model, folder)
            self._request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            if old is not None:  # the server keeps one adapter of this run: the policy's now
                self._request("/v1/unload_lora_adapter", {"lora_name": old})
                shutil.rmtree(self.sync_dir / f"adapter-{self._adapter_id - 1}", ignore_errors=True)

        self._on_main(load)
        self._adapter_name = name

    def _sync_weights(self) -> None:
        from safetensors.torch import save_file

        self._adapter_id += 1
        folder = self.sync_dir / f"weights-{self._adapter_id}"

        def reload() -> None:
            folder.mkdir()
            # one file; tied matrices saved as separate copies (safetensors refuses shared storage)
            save_file({name: t.detach().to("cpu").contiguous().clone() for name, t in self.policy_weights()},
                      str(folder / "model.safetensors"))
            self._request("/collective_rpc", {"method": "reload_weights",
                                              "kwargs": {"weights_path": str(folder)}})
            self._request("/reset_prefix_cache", {})  # cached prompt KV came from the old weights
            shutil.rmtree(self.sync_dir / f"weights-{self._adapter_id - 1}", ignore_errors=True)

        self._on_main(reload)

    def _on_main(self, change: Callable[[], None]) -> None:
        """Makes ``change`` to the shared server on rank 0 alone (on one process: here); every other rank
        waits for its outcome before it samples, and raises rank 0's error if it failed."""
        failure = None
        if self.world.is_main:
            try:
                change()
            except Exception as exc:
                failure = exc
        told = self.world.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if told is not None:
            raise RuntimeError(f"rank 0 could not sync the policy to the vLLM server at {self.base_url}, "
                               f"so this rank stops too: {told}")

    # -- sampling --------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, prompts: Sequence[Prompt], *, group_size: int, temperature: float | None = None,
               draws: Draws | None = None) -> RolloutBatch:
        """``group_size`` completions per prompt from the server, after a weight sync if one is due."""
        if not prompts:
            raise ValueError("sample() got no prompts; pass at least one Prompt")
        temperature = self.temperature if temperature is None else temperature
        draws = draws if draws is not None else Draws.seeded()
        self.last_sync_seconds = self._ready()
        ids, mask = self.encode_prompts(prompts)
        model = self._model_name()
        bodies = [{"model": model, "prompt": row[m].tolist(), "n": group_size, "temperature": temperature,
                   "top_p": self.top_p, "top_k": self.top_k if self.top_k > 0 else -1,
                   "max_tokens": self.max_completion_tokens, "logprobs": 0, "return_token_ids": True,
                   "seed": (draws.seed + draws.first_prompt + b) % 2**31, "stop_token_ids": self.eos_ids,
                   "skip_special_tokens": True}
                  for b, (row, m) in enumerate(zip(ids, mask))]
        answers = self._complete(bodies)
        rows = []
        for answer in answers:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if len(choices) != group_size:
                raise RuntimeError(f"the vLLM server returned {len(choices)} completions for a prompt, not "
                                   f"group_size={group_size}")
            for c in choices:
                tokens, logprobs = list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])
                if len(tokens) != len(logprobs):
                    raise RuntimeError(f"the vLLM server returned {len(tokens)} token ids with "
                                       f"{len(logprobs)} log-probs; it must return one per sampled token")
                rows.append((tokens, logprobs))
        return self._batch(prompts, group_size, ids, mask, rows)

    @torch.no_grad()
    def generate_turn(self, contexts: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                      places: Sequence[int], temperature: float, seed: int,
                      stop_texts: Sequence[str]) -> list[Turn]:
        """One model turn per context from the server, each context sent as its exact token ids (one
        ``/v1/completions`` request per row; the server's prefix cache serves what an earlier turn
        computed), after a weight sync if one is due (the first turn of a step; later turns find nothing
        changed); the :class:`~grpo_engine.sampling.turns.TurnGenerator` protocol, with the requests of
        :func:`~grpo_engine.sampling.vllm_turns.turn_requests`.

        Example:
            >>> # turns = sampler.generate_turn([prompt_ids], max_new_tokens=[64], places=[0],
            >>> #                               temperature=1.0, seed=0, stop_texts=["</tool_call>"])
        """
        settings = turn_requests(contexts, max_new_tokens=max_new_tokens, places=places,
                                 temperature=temperature, seed=seed, stop_texts=stop_texts, top_p=self.top_p,
                                 top_k=self.top_k, eos_ids=self.eos_ids)
        if not settings:
            return []
        self.last_sync_seconds = self._ready()
        model = self._model_name()
        answers = self._complete([{"model": model, "prompt": [int(i) for i in context], **request,
                                   "return_token_ids": True} for context, request in zip(contexts, settings)])
        turns = []
        for answer in answers:
            (choice,) = answer["choices"]
            turns.append(as_turn(choice["token_ids"], choice["logprobs"]["token_logprobs"],
                                 finish_reason=choice.get("finish_reason"),
                                 stop_reason=choice.get("stop_reason"), eos_ids=self.eos_ids))
        return turns

    def _ready(self) -> float:
        """Checks the server (at the first call) and syncs the policy's weights if they changed (a cheap
        check when they did not); returns the seconds the sync took."""
        if not self.started:
            self._start()
        return self.sync()

    def _model_name(self) -> str:
        """The name requests sample with: the policy's adapter, else the served base model."""
        return self._adapter_name if self.lora and self.lora_sync == "adapter" else self.served_model

    def _complete(self, bodies: list[dict[str, Any]]) -> list[Any]:
        """POSTs every body to ``/v1/completions`` at once (the server batches them); the answers in order."""
        with ThreadPoolExecutor(max_workers=min(len(bodies), 64)) as pool:
            return list(pool.map(lambda body: self._request("/v1/completions", body), bodies))

    def close(self) -> None:
        """Unloads the policy's adapter from the server (rank 0: the adapter is every rank's) and removes
        what was saved for it."""
        if self._adapter_name is not None and self.world.is_main:
            try:
                self._request("/v1/unload_lora_adapter", {"lora_name": self._adapter_name})
            except (RuntimeError, ConnectionError):
                pass  # the server is gone or restarted: nothing of ours is loaded
        self._adapter_name = None
        super().close()
