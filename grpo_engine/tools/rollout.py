"""ToolSampler: multi-turn rollouts in which the model calls tools, on exact tokens.

A row is one sequence: the prompt (rendered by the tokenizer's chat template with the tools' schemas),
then the model's turns and the environment's messages one after another. Each turn:

1. Every row still running generates, all of them in one batch (each from its own context, left-padded,
   prefilled afresh), until its EOS, the text that closes a tool call (``parser.stop_text``), or its
   token budget. The sampled ids are kept as sampled, never decoded and re-encoded.
2. Its text is parsed for tool calls. None: the row is done (the model answered). Otherwise the calls
   run (:func:`~grpo_engine.tools.functions.call_tools`: a time limit per call, errors and long results
   reported, one environment's methods never at the same time) and the tools' messages are appended as
   the chat template's own ids for them (:mod:`~grpo_engine.tools.messages`): the frame the template
   writes after an assistant turn (its end-of-turn marker, unless the model sampled it as its EOS),
   around each tool message and through the next generation prompt, found by rendering the template
   with placeholders, with special tokens; each tool's text tokenised as text, so nothing a tool prints
   becomes a special token. Those tokens are marked in ``env_mask``: attended to, never trained on.

Limits: ``max_turns`` model turns (a row that still calls a tool in its last turn stops there, counted in
``turns/limit_reached``); the sampler's ``max_completion_tokens`` for the whole rollout, model and
environment tokens together (a row that runs out is truncated); ``tool_timeout_s`` and ``max_tool_chars``
per call. A row whose environment's call timed out ends there (the call may still be changing the
environment; ``turns/ended_by_timeout``). The step logs ``tools/calls``, ``tools/errors``,
``tools/timeouts``, ``tools/cut_outputs``, ``turns/limit_reached``, ``turns/ended_by_timeout`` and
``turns/mean``. Each turn's draws are seeded by the call's seed and the turn, and keyed by the row's
place in the whole step, so K ranks sample what one process samples.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_engine.data.templates import ChatTemplate
from grpo_engine.sampling.decode import decode, is_decoder_lm, seeded_rng
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.tools.functions import (
    Tool,
    as_tool,
    call_tools,
    ends_rollout,
    environment_tools,
    reset_environment,
)
from grpo_engine.tools.messages import environment_ids
from grpo_engine.tools.parsers import HermesParser, ToolCallParser
from grpo_engine.types import Draws, Episode, Prompt, RolloutBatch

__all__ = ["ToolSampler", "with_tools"]


@dataclasses.dataclass
class _Row:
    """One rollout being built."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]  # the prompt's, for rendering the tools' messages
    tools: dict[str, Tool]
    environment: Any = None
    ids: list[int] = dataclasses.field(default_factory=list)
    env: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    said: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the conversation after the prompt
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    ended_with_eos: bool = False  # the last turn ended with the model's EOS
    last_text: str = ""
    cut: bool = False  # the prompt was longer than max_prompt_tokens and lost its middle


class ToolSampler:
    """Samples multi-turn rollouts with tools (see the module docstring); the Sampler protocol.

    Args:
        sampler: the single-turn sampler whose model, tokenizer, template, token draw and budgets
            (``max_prompt_tokens``; ``max_completion_tokens``, here the whole rollout's) it uses.
        tools: plain functions (type hints and a docstring with ``Args:``) or :class:`Tool` objects.
        environment_factory: a class (or function) making one environment per rollout (TRL's shape):
            ``reset(**fields)`` is called with the prompt's fields it accepts and may return text that
            the first user message ends with; its public methods are the row's tools besides ``tools``;
            rewards read it (``RolloutBatch.episodes[i].environment``, or ``environments=`` of a
            reward function).
        parser: reads the tool calls (default :class:`~grpo_engine.tools.parsers.HermesParser`).
        max_turns: model turns per rollout.
        tool_timeout_s: seconds per tool call.
        max_tool_chars: characters of a tool's result the model reads (the rest is cut, and it is told).
        stop_at_call: end a turn at the text that closes a tool call (else at EOS only).
        tool_workers: rows whose tools run side by side.

    Example:
        >>> # sampler = ToolSampler(HFSampler(model, tokenizer, max_completion_tokens=256), tools=[multiply])
        >>> # batch = sampler.sample([Prompt("What is 123 * 456?", "56088")], group_size=4)
    """

    def __init__(self, sampler: HFSampler, *, tools: Sequence[Callable[..., Any] | Tool] = (),
                 environment_factory: Callable[[], Any] | None = None, parser: ToolCallParser | None = None,
                 max_turns: int = 4, tool_timeout_s: float = 10.0, max_tool_chars: int = 4000,
                 stop_at_call: bool = True, tool_workers: int = 8) -> None:
        if not isinstance(sampler.template, ChatTemplate):
            raise ValueError(f"ToolSampler needs a chat template to render tools and their messages; the "
                             f"sampler's template is {type(sampler.template).__name__}: set "
                             "tokenizer.chat_template or pass template=ChatTemplate()")
        if not is_decoder_lm(sampler.model):
            raise ValueError(f"ToolSampler runs our decoding loop, which needs a transformers causal LM; got "
                             f"{type(sampler.model).__name__}")
        for name, value, rule in (("max_turns", max_turns, max_turns >= 1),
                                  ("tool_timeout_s", tool_timeout_s, tool_timeout_s > 0),
                                  ("max_tool_chars", max_tool_chars, max_tool_chars >= 1)):
            if not rule:
                raise ValueError(f"ToolSampler: {name}={value!r} must be positive (>= 1 for counts)")
        self.base, self.tokenizer = sampler, sampler.tokenizer
        self.tools = [as_tool(t) for t in tools]
        self.environment_factory, self.parser = environment_factory, parser or HermesParser()
        self.max_turns, self.tool_timeout_s, self.max_tool_chars = max_turns, tool_timeout_s, max_tool_chars
        self.stop_at_call, self.tool_workers = stop_at_call, tool_workers
        probe = environment_factory() if environment_factory is not None else None
        every = self.tools + (environment_tools(probe) if probe is not None else [])
        names = [t.name for t in every]
        if not names:
            raise ValueError("ToolSampler got no tool: pass tools=[fn, ...] or an environment_factory whose "
                             "class has public methods")
        if len(set(names)) != len(names):
            raise ValueError(f"ToolSampler: two tools share a name among {names}; rename one")
        self.schemas = [dict(t.schema) for t in every]
        self.renders_tools = self._template_renders_tools()

    # -- rendering -------------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], *, with_tools: bool | None = None) -> str:
        show = self.renders_tools if with_tools is None else with_tools
        extra = {"tools": self.schemas} if show else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **extra)

    def _template_renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "?"}]
        try:
            return self._render(probe, with_tools=True) != self._render(probe, with_tools=False)
        except Exception:  # a template that refuses tools= does not render them
            return False

    def messages(self, prompt: Prompt, observation: str | None = None) -> list[dict[str, Any]]:
        """The prompt's chat messages: the template's, the environment's observation at the end of the
        last user message, and the tools described in the system message when the chat template does
        not render them itself."""
        messages = self.base.template.messages(prompt)
        if observation:
            last = max(i for i, m in enumerate(messages) if m.get("role") == "user") if any(
                m.get("role") == "user" for m in messages) else len(messages) - 1
            messages[last] = {**messages[last], "content": messages[last]["content"] + observation}
        if not self.renders_tools:
            tools = self.parser.system_prompt(self.schemas)
            if messages and messages[0].get("role") == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools}
            else:
                messages.insert(0, {"role": "system", "content": tools})
        return messages

    def prompt_tokens(self, prompt: Prompt) -> list[int]:
        """The token ids of the rendered prompt (tools included), whole."""
        return self.base.encode_text(self._render(self.messages(prompt)))

    def env_tokens(self, messages: list[dict[str, Any]], tool_messages: list[dict[str, Any]], *,
                   sampled_eos: int | None = None) -> list[int]:
        """The chat template's ids for ``tool_messages`` after an assistant turn of the conversation
        ``messages``, through the next generation prompt: the frame's ids as the template's, each content
        tokenised as text (:func:`~grpo_engine.tools.messages.environment_ids`); without the turn's end
        marker when the model sampled it as its EOS (``sampled_eos``)."""
        return environment_ids(self._render, self.tokenizer, messages, tool_messages, sampled_eos=sampled_eos)

    # -- sampling --------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, prompts: Sequence[Prompt], *, group_size: int, temperature: float | None = None,
               draws: Draws | None = None) -> RolloutBatch:
        """``group_size`` multi-turn rollouts per prompt (rows ``b*G ..`` of prompt b)."""
        if not prompts:
            raise ValueError("sample() got no prompts; pass at least one Prompt")
        temperature = self.base.temperature if temperature is None else temperature
        draws = draws if draws is not None else Draws.seeded()
        rows = [self._start(p) for p in prompts for _ in range(group_size)]
        counts = dict.fromkeys(("tools/calls", "tools/errors", "tools/timeouts", "tools/cut_outputs",
                                "turns/limit_reached", "turns/ended_by_timeout"), 0.0)
        model = self.base.model
        was_training = model.training
        model.eval()
        try:
            for turn in range(self.max_turns):
                running = [i for i, r in enumerate(rows) if not r.done]
                if not running:
                    break
                self._generate(rows, running, temperature, draws, turn, group_size, len(prompts))
                self._act(rows, running, last_turn=turn == self.max_turns - 1, counts=counts)
        finally:
            model.train(was_training)
        return self._batch(prompts, group_size, rows, counts)

    def _start(self, prompt: Prompt) -> _Row:
        environment = self.environment_factory() if self.environment_factory is not None else None
        observation = (reset_environment(environment, prompt, timeout_s=self.tool_timeout_s)
                       if environment is not None else None)
        messages = self.messages(prompt, observation)
        tools = {t.name: t for t in self.tools + (environment_tools(environment) if environment else [])}
        ids = self.base.encode_text(self._render(messages))
        limit = self.base.max_prompt_tokens
        cut = len(ids) > limit
        if cut:  # keep the head (system, tools) and the end (question, generation prompt)
            warnings.warn(f"a prompt of {len(ids)} tokens (tools included) is longer than max_prompt_tokens="
                          f"{limit}: its middle was cut; raise max_prompt_tokens", stacklevel=4)
            ids = ids[:limit - limit // 2] + ids[len(ids) - limit // 2:]
        return _Row(ids, messages, tools, environment, cut=cut)

    def _generate(self, rows: list[_Row], running: list[int], temperature: float, draws: Draws, turn: int,
                  group_size: int, num_prompts: int) -> None:
        """One turn of every running row, in one batch; appends each row's sampled ids."""
        budget = self.base.max_completion_tokens
        limits = [budget - len(rows[i].ids) for i in running]
        contexts = [rows[i].prompt_ids + rows[i].ids for i in running]
        device = next(self.base.model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(running), width), self.base.pad_id, dtype=torch.long)
        mask = torch.zeros((len(running), width), dtype=torch.bool)
        for k, context in enumerate(contexts):
            ids[k, width - len(context):] = torch.tensor(context)
            mask[k, width - len(context):] = True
        stopped: dict[int, int] = {}
        closes = self.parser.stop_text or callable(getattr(self.parser, "call_closed", None))
        stop = self._stop(stopped) if self.stop_at_call and closes else None
        place = torch.tensor(running, device=device) + draws.first_prompt * group_size
        with seeded_rng((draws.seed + 1_000_003 * turn) % 2**62, device):
            out, logprobs = decode(self.base.model, ids.to(device), mask.to(device), repeats=1,
                                   max_new_tokens=max(limits), eos_ids=self.base.eos_ids,
                                   pad_id=self.base.pad_id, draw=self.base.token_draw(temperature),
                                   total_rows=draws.total(num_prompts) * group_size, draw_rows=place,
                                   stop=stop)
        out, eos = out.cpu(), torch.isin(out.cpu(), torch.tensor(self.base.eos_ids))
        for k, i in enumerate(running):
            ends = [stopped[k]] if k in stopped else (eos[k].nonzero().flatten()[:1] + 1).tolist()
            length = min(ends[0] if ends else out.shape[1], limits[k])
            row = rows[i]
            row.truncated = not ends or ends[0] > limits[k]
            row.ended_with_eos = bool(length and eos[k, length - 1])
            row.ids += out[k, :length].tolist()
            row.env += [False] * length
            row.logprobs += (logprobs[k, :length].float().cpu().tolist() if logprobs is not None
                             else [0.0] * length)
            row.turns += 1
            row.last_text = self.tokenizer.decode(out[k, :length].tolist(), skip_special_tokens=True)
            row.said.append({"role": "assistant", "content": row.last_text})

    def _stop(self, stopped: dict[int, int]) -> Callable[[Tensor, Tensor], Tensor]:
        """The decode loop's stop test: the turn's last tokens hold the text that closes a tool call, or
        the parser's ``call_closed`` says the turn so far holds a whole call (records each stopped row's
        length in ``stopped``)."""
        text = self.parser.stop_text
        window = len(text) + 2 if text else None  # every token of that text adds at least one character
        closed = (lambda turn: text in turn) if text else self.parser.call_closed

        def stop(ids: Tensor, rows: Tensor) -> Tensor:
            turns = self.tokenizer.batch_decode((ids[:, -window:] if window else ids).tolist(),
                                                skip_special_tokens=False)
            hit = torch.tensor([closed(turn) for turn in turns], dtype=torch.bool)
            for r in rows.cpu()[hit].tolist():
                stopped.setdefault(r, ids.shape[1])
            return hit

        return stop

    def _act(self, rows: list[_Row], running: list[int], *, last_turn: bool,
             counts: dict[str, float]) -> None:
        """Parses the running rows' turns, runs their tool calls and appends the tools' messages."""
        asking = []
        for i in running:
            row = rows[i]
            calls = [] if row.truncated else self.parser.parse(row.last_text)
            row.calls += calls
            if not calls or last_turn:
                row.done = True
                counts["turns/limit_reached"] += float(bool(calls))
            else:
                asking.append((i, calls))
        results = call_tools([(rows[i].tools, calls) for i, calls in asking], timeout_s=self.tool_timeout_s,
                             max_chars=self.max_tool_chars, workers=self.tool_workers)
        for (i, calls), answers in zip(asking, results):
            row = rows[i]
            replies = [{"role": "tool", "name": call.get("name") or "", "content": answer.content}
                       for call, answer in zip(calls, answers)]
            counts["tools/calls"] += len(calls)
            counts["tools/errors"] += sum(a.status == "error" for a in answers)
            counts["tools/timeouts"] += sum(a.status == "timeout" for a in answers)
            counts["tools/cut_outputs"] += sum(a.cut for a in answers)
            row.said += replies
            if any(ends_rollout(row.tools, call, answer) for call, answer in zip(calls, answers)):
                row.done = True  # its environment may still change: no more calls, no more turns
                counts["turns/ended_by_timeout"] += 1.0
                continue
            eos = row.ids[-1] if row.ended_with_eos else None
            written = self.env_tokens(row.messages, replies, sampled_eos=eos)
            if len(row.ids) + len(written) >= self.base.max_completion_tokens:  # no room left to answer
                row.done = row.truncated = True
                continue
            row.ids += written
            row.env += [True] * len(written)
            row.logprobs += [0.0] * len(written)

    def _batch(self, prompts: Sequence[Prompt], group_size: int, rows: list[_Row],
               counts: dict[str, float]) -> RolloutBatch:
        """The rows as a RolloutBatch (prompts left-padded, rollouts right-padded)."""
        pad, n = self.base.pad_id, len(rows)
        p_width, c_width = max(len(r.prompt_ids) for r in rows), max(1, max(len(r.ids) for r in rows))
        prompt_ids = torch.full((n, p_width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_width), dtype=torch.bool)
        completion_ids = torch.full((n, c_width), pad, dtype=torch.long)
        completion_mask = torch.zeros((n, c_width), dtype=torch.bool)
        env_mask = torch.zeros((n, c_width), dtype=torch.bool)
        logprobs = torch.zeros((n, c_width), dtype=torch.float32)
        for k, r in enumerate(rows):
            prompt_ids[k, p_width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            prompt_mask[k, p_width - len(r.prompt_ids):] = True
            completion_ids[k, :len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
            completion_mask[k, :len(r.ids)] = True
            env_mask[k, :len(r.env)] = torch.tensor(r.env, dtype=torch.bool)
            logprobs[k, :len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
        device = next(self.base.model.parameters()).device
        episodes = tuple(Episode(tuple(r.said), tuple(r.calls), r.turns, r.environment) for r in rows)
        return RolloutBatch(
            prompts=tuple(prompts), group_size=group_size, prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device), completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            is_truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool, device=device),
            texts=tuple(r.last_text for r in rows),
            sampler_logprobs=logprobs.to(device) if self.base.return_logprobs else None,
            metrics={"prompts/truncated": float(sum(r.cut for r in rows[::group_size])), **counts},
            env_mask=env_mask.to(device), episodes=episodes)


def with_tools(sampler: Any, tools: Sequence[Callable[..., Any] | Tool],
               environment_factory: Callable[[], Any] | None, config: Any) -> Any:
    """``sampler`` itself without tools or an environment, else a :class:`ToolSampler` over it with the
    limits of ``config`` (``max_turns``, ``tool_timeout_s``, ``max_tool_chars``): the trainer's
    ``tools=`` / ``environment_factory=``.

    Raises:
        ValueError: tools for a sampler that is not an ``HFSampler`` (pass a ToolSampler as the sampler).
    """
    if not tools and environment_factory is None:
        return sampler
    if not isinstance(sampler, HFSampler):
        raise ValueError(f"tools= and environment_factory= wrap the default HFSampler; the sampler is "
                         f"{type(sampler).__name__}: build ToolSampler(HFSampler(...), tools=...) yourself "
                         "and pass it as sampler=")
    return ToolSampler(sampler, tools=tools, environment_factory=environment_factory,
                       max_turns=config.max_turns, tool_timeout_s=config.tool_timeout_s,
                       max_tool_chars=config.max_tool_chars)
