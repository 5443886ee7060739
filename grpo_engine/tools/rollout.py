"""ToolSampler: multi-turn rollouts in which the model calls tools, on exact tokens.

A row is one sequence: the prompt (rendered by the tokenizer's chat template with the tools' schemas),
then the model's turns and the environment's messages one after another. Each turn:

1. Every row still running generates, all of them in one batch, until its EOS, the text that closes a
   tool call (``parser.stop_text``), or its token budget. The sampled ids are kept as sampled, never
   decoded and re-encoded. A sampler with ``generate_turn`` (vLLM) generates the turn itself; else our
   decoding loop does, keeping each row's KV cache from one turn to the next, so a turn prefills only the
   environment's new tokens (:class:`~grpo_engine.sampling.turn_decode.CachedTurns`; ``kv_cache=False``:
   each context left-padded and prefilled whole, the same tokens). ``turns/prefill_tokens`` counts them.
2. Its text is parsed for tool calls. None: the row is done (the model answered). Otherwise the calls
   run (:func:`~grpo_engine.tools.functions.call_tools`: a time limit per call, errors and long results
   reported, one environment's methods never at the same time) and the tools' messages are appended as
   the chat template's own ids for them (:mod:`~grpo_engine.tools.messages`): the frame the template
   writes after an assistant turn (its end-of-turn marker, unless the model sampled it as its EOS),
   around each tool message and through the next generation prompt, found by rendering the template
   with placeholders, with special tokens; each tool's text tokenised as text, so nothing a tool prints
   becomes a special token. Those tokens are marked in ``env_mask``: attended to, never trained on.

Limits, and how a row ends (``Episode.end``; the messages, the tokens, the environment and
``is_truncated`` agree in each, and every end but ``answered`` is truncated): ``answered``, a turn without
a tool call. ``turn_limit``: a call in the last of ``max_turns`` turns is parsed (``Episode.tool_calls``)
and not run, as TRL's and verl's loops do (``turns/limit_reached``). The sampler's
``max_completion_tokens`` bounds the whole rollout, model and environment tokens together:
``token_limit``, a turn that runs out (mid-call: the call is not read), or whose calls' replies could
not fit even empty with a token to spare (not run, so the environment is untouched);
``reply_too_long``, the calls ran and their replies leave no room for another turn: the replies' text is
cut (in order, the last kept one mid-way) to what fits, and the cut messages are both the episode's and
the tokens'. ``tool_timeout``: an environment's call timed out (it may still be changing the
environment; ``turns/ended_by_timeout``); its replies are written as any others (cut if they do not
fit). ``tool_timeout_s`` and ``max_tool_chars`` apply per call. The step logs ``tools/calls``,
``tools/errors``, ``tools/timeouts``, ``tools/cut_outputs``, ``turns/limit_reached``,
``turns/ended_by_timeout``, ``ends/<end>`` (rows per end state) and ``turns/mean``. Each turn's draws
are seeded by the call's seed and the turn, and keyed by the row's place in the whole step, so K ranks
sample what one process samples.
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
from grpo_engine.sampling.turn_decode import CachedTurns, StopCheck, keeps_cache
from grpo_engine.sampling.turns import Turn, TurnGenerator
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
from grpo_engine.types import EPISODE_ENDS, Draws, Episode, Prompt, RolloutBatch

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
    end: str = ""  # set when the row is done: one of EPISODE_ENDS


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
        kv_cache: keep each row's KV cache from one turn to the next on our decoding loop
            (:class:`~grpo_engine.sampling.turn_decode.CachedTurns`: a turn prefills only the environment's
            new tokens); False re-prefills every row's whole context each turn (the same tokens and
            log-probs, slower); None (default) keeps it when the model allows
            (:func:`~grpo_engine.sampling.turn_decode.keeps_cache`). A sampler with ``generate_turn`` (vLLM)
            generates every turn itself either way.

    Example:
        >>> # sampler = ToolSampler(HFSampler(model, tokenizer, max_completion_tokens=256), tools=[multiply])
        >>> # batch = sampler.sample([Prompt("What is 123 * 456?", "56088")], group_size=4)
    """

    def __init__(self, sampler: HFSampler, *, tools: Sequence[Callable[..., Any] | Tool] = (),
                 environment_factory: Callable[[], Any] | None = None, parser: ToolCallParser | None = None,
                 max_turns: int = 4, tool_timeout_s: float = 10.0, max_tool_chars: int = 4000,
                 stop_at_call: bool = True, tool_workers: int = 8, kv_cache: bool | None = None) -> None:
        if not isinstance(sampler.template, ChatTemplate):
            raise ValueError(f"ToolSampler needs a chat template to render tools and their messages; the "
                             f"sampler's template is {type(sampler.template).__name__}: set "
                             "tokenizer.chat_template or pass template=ChatTemplate()")
        if not isinstance(sampler, TurnGenerator) and not is_decoder_lm(sampler.model):
            raise ValueError(f"ToolSampler runs our decoding loop, which needs a transformers causal LM; got "
                             f"{type(sampler.model).__name__}: use one, or a sampler with generate_turn "
                             "(VLLMSampler, VLLMServerSampler)")
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
        why_not = None if isinstance(sampler, TurnGenerator) else keeps_cache(sampler.model)
        if kv_cache and why_not:
            raise ValueError(f"ToolSampler(kv_cache=True): the KV cache cannot be kept across turns for "
                             f"{type(sampler.model).__name__}: {why_not}; pass kv_cache=None or False")
        self.kv_cache = why_not is None if kv_cache is None else kv_cache
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
                                "turns/limit_reached", "turns/ended_by_timeout", "turns/prefill_tokens"), 0.0)
        model = self.base.model
        was_training = model.training
        model.eval()
        turns = self._turns()
        try:
            for turn in range(self.max_turns):
                running = [i for i, r in enumerate(rows) if not r.done]
                if not running:
                    break
                counts["turns/prefill_tokens"] += self._generate(rows, running, temperature, draws, turn,
                                                                 group_size, len(prompts), turns)
                self._act(rows, running, last_turn=turn == self.max_turns - 1, counts=counts)
        finally:
            model.train(was_training)
            if isinstance(turns, CachedTurns):
                turns.reset()  # every row's KV cache freed
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

    def _turns(self) -> TurnGenerator | None:
        """What generates each turn: the sampler itself when it can (vLLM), our decoding loop keeping each
        row's KV cache (``kv_cache``), or None: our loop prefilling every context whole."""
        if isinstance(self.base, TurnGenerator):
            return self.base
        if not self.kv_cache:
            return None
        return CachedTurns(self.base.model, self.tokenizer, eos_ids=self.base.eos_ids,
                           pad_id=self.base.pad_id, token_draw=self.base.token_draw)

    def _generate(self, rows: list[_Row], running: list[int], temperature: float, draws: Draws, turn: int,
                  group_size: int, num_prompts: int, turns: TurnGenerator | None) -> float:
        """One turn of every running row, in one batch, by ``turns`` (:meth:`_turns`); appends each row's
        sampled ids. Returns the context tokens the turn prefilled: the whole contexts when re-prefilled;
        the tokens new since the row's last turn through a generator (for a sampler's own engine, what its
        prefix cache must prefill at least)."""
        limits = [self.base.max_completion_tokens - len(rows[i].ids) for i in running]
        contexts = [rows[i].prompt_ids + rows[i].ids for i in running]
        text = self.parser.stop_text if self.stop_at_call else None
        closed = getattr(self.parser, "call_closed", None) if self.stop_at_call and not text else None
        args = dict(max_new_tokens=limits, places=[i + draws.first_prompt * group_size for i in running],
                    temperature=temperature, seed=(draws.seed + 1_000_003 * turn) % 2**62,
                    stop_texts=(text,) if text else ())
        total = draws.total(num_prompts) * group_size
        if turns is None:
            made = self._reprefilled(contexts, StopCheck(self.tokenizer, args["stop_texts"], closed), total,
                                     **args)
            prefilled = sum(map(len, contexts))
        elif isinstance(turns, CachedTurns):
            before = turns.prefilled
            made = turns.generate_turn(contexts, total_rows=total, closed=closed, **args)
            prefilled = turns.prefilled - before
        else:
            made = turns.generate_turn(contexts, **args)
            prefilled = sum(_since_last_turn(rows[i]) for i in running)
        for i, out in zip(running, made):
            row = rows[i]
            row.truncated, row.ended_with_eos = out.ended == "length", out.ended == "eos"
            row.ids += out.ids
            row.env += [False] * len(out.ids)
            row.logprobs += out.logprobs
            row.turns += 1
            row.last_text = self.tokenizer.decode(list(out.ids), skip_special_tokens=True)
            row.said.append({"role": "assistant", "content": row.last_text})
        return float(prefilled)

    def _reprefilled(self, contexts: list[list[int]], check: StopCheck, total: int, *,
                     max_new_tokens: list[int], places: list[int], temperature: float, seed: int,
                     stop_texts: Sequence[str]) -> list[Turn]:
        """One turn of each context on our decoding loop, every context left-padded and prefilled whole
        (``kv_cache=False``); ``check`` holds ``stop_texts``."""
        device = next(self.base.model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.base.pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.bool)
        for k, context in enumerate(contexts):
            ids[k, width - len(context):] = torch.tensor(context)
            mask[k, width - len(context):] = True
        stopped: dict[int, int] = {}
        with seeded_rng(seed, device):
            out, logprobs = decode(self.base.model, ids.to(device), mask.to(device), repeats=1,
                                   max_new_tokens=max(max_new_tokens), eos_ids=self.base.eos_ids,
                                   pad_id=self.base.pad_id, draw=self.base.token_draw(temperature),
                                   total_rows=total, draw_rows=torch.tensor(places, device=device),
                                   stop=self._stop(check, stopped) if check.active else None)
        out, eos = out.cpu(), torch.isin(out.cpu(), torch.tensor(self.base.eos_ids))
        made = []
        for k, limit in enumerate(max_new_tokens):
            ends = [stopped[k]] if k in stopped else (eos[k].nonzero().flatten()[:1] + 1).tolist()
            length = min(ends[0] if ends else out.shape[1], limit)
            ended = "length" if not ends or ends[0] > limit else "eos" if eos[k, length - 1] else "stop"
            sampled = (logprobs[k, :length].float().cpu().tolist() if logprobs is not None
                       else [0.0] * length)
            made.append(Turn(tuple(out[k, :length].tolist()), tuple(sampled), ended))
        return made

    @staticmethod
    def _stop(check: StopCheck, stopped: dict[int, int]) -> Callable[[Tensor, Tensor], Tensor]:
        """The decode loop's stop test: ``check`` (the text that closes a tool call, or the parser's
        ``call_closed``) on the turn so far; records each stopped row's length in ``stopped``."""

        def stop(ids: Tensor, rows: Tensor) -> Tensor:
            hit = check(ids.cpu())
            for r in rows.cpu()[hit].tolist():
                stopped.setdefault(r, ids.shape[1])
            return hit

        return stop

    def _act(self, rows: list[_Row], running: list[int], *, last_turn: bool,
             counts: dict[str, float]) -> None:
        """Parses the running rows' turns, runs their tool calls and appends the tools' messages (to the
        conversation and the tokens alike); a row that stops here gets its end state."""
        asking = []
        for i in running:
            row = rows[i]
            calls = [] if row.truncated else self.parser.parse(row.last_text)
            row.calls += calls
            end = self._end_before_calls(row, calls, last_turn=last_turn)
            if end:
                row.done, row.end = True, end
                counts["turns/limit_reached"] += float(end == "turn_limit")
            else:
                asking.append((i, calls))
        results = call_tools([(rows[i].tools, calls) for i, calls in asking], timeout_s=self.tool_timeout_s,
                             max_chars=self.max_tool_chars, workers=self.tool_workers)
        for (i, calls), answers in zip(asking, results):
            row = rows[i]
            counts["tools/calls"] += len(calls)
            counts["tools/errors"] += sum(a.status == "error" for a in answers)
            counts["tools/timeouts"] += sum(a.status == "timeout" for a in answers)
            counts["tools/cut_outputs"] += sum(a.cut for a in answers)
            replies, written, room_left = self._fitted(row, [
                {"role": "tool", "name": call.get("name") or "", "content": answer.content}
                for call, answer in zip(calls, answers)])
            row.said += replies
            row.ids += written
            row.env += [True] * len(written)
            row.logprobs += [0.0] * len(written)
            if any(ends_rollout(row.tools, call, answer) for call, answer in zip(calls, answers)):
                row.done, row.end = True, "tool_timeout"  # its environment may still change: no more calls
                counts["turns/ended_by_timeout"] += 1.0
            elif not room_left:
                row.done, row.end = True, "reply_too_long"

    def _end_before_calls(self, row: _Row, calls: list[dict[str, Any]], *, last_turn: bool) -> str | None:
        """How the row ends before its calls run (None: they run): the budget ran out in the turn, no call,
        a call in the last turn, or no room for the calls' replies even empty and one more model token."""
        if row.truncated:
            return "token_limit"
        if not calls:
            return "answered"
        if last_turn:
            return "turn_limit"
        empty = self._written(row, [{"role": "tool", "name": c.get("name") or "", "content": ""}
                                    for c in calls])
        return "token_limit" if len(row.ids) + len(empty) >= self.base.max_completion_tokens else None

    def _written(self, row: _Row, replies: list[dict[str, Any]]) -> list[int]:
        """The environment's ids for ``replies`` after the row's last turn."""
        return self.env_tokens(row.messages, replies, sampled_eos=row.ids[-1] if row.ended_with_eos else None)

    def _fitted(self, row: _Row,
                replies: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int], bool]:
        """The replies as the row keeps them, their ids, and whether a model token still fits after them.
        Replies whose ids do not leave that token are cut, as one text in order, to the most characters
        whose ids fit in the budget (their ids empty fit: :meth:`_end_before_calls`)."""
        room = self.base.max_completion_tokens - len(row.ids)
        written = self._written(row, replies)
        if len(written) < room:
            return replies, written, True
        if len(written) == room:
            return replies, written, False
        texts = [str(r["content"]) for r in replies]

        def cut(keep: int) -> list[dict[str, Any]]:
            out = []
            for reply, text in zip(replies, texts):
                out.append({**reply, "content": text[:max(keep, 0)]})
                keep -= len(text)
            return out

        fits, over = 0, sum(map(len, texts))  # ids(fits) fit in the room, ids(over) do not
        while over - fits > 1:
            middle = (fits + over) // 2
            fits, over = (middle, over) if len(self._written(row, cut(middle))) <= room else (fits, middle)
        return cut(fits), self._written(row, cut(fits)), False

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
        assert all(r.end in EPISODE_ENDS for r in rows), "every row ends with an end state"
        episodes = tuple(Episode(tuple(r.said), tuple(r.calls), r.turns, r.environment, r.end) for r in rows)
        ends = {f"ends/{end}": float(sum(r.end == end for r in rows)) for end in EPISODE_ENDS}
        return RolloutBatch(
            prompts=tuple(prompts), group_size=group_size, prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device), completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            is_truncated=torch.tensor([r.end != "answered" for r in rows], dtype=torch.bool, device=device),
            texts=tuple(r.last_text for r in rows),
            sampler_logprobs=logprobs.to(device) if self.base.return_logprobs else None,
            metrics={"prompts/truncated": float(sum(r.cut for r in rows[::group_size])), **counts, **ends},
            env_mask=env_mask.to(device), episodes=episodes)


def _since_last_turn(row: _Row) -> int:
    """The context tokens the row got since its last turn: its prompt before the first, then the
    environment's tokens written after its last model token."""
    model = [k for k, env in enumerate(row.env) if not env]
    return len(row.prompt_ids) + len(row.ids) if not model else len(row.ids) - model[-1] - 1


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
    if not isinstance(sampler, HFSampler):  # the vLLM samplers are HFSamplers: they generate each turn
        raise ValueError(f"tools= and environment_factory= wrap the default HFSampler or a vLLM sampler; "
                         f"the sampler is {type(sampler).__name__}: build ToolSampler(HFSampler(...), "
                         "tools=...) yourself and pass it as sampler=")
    return ToolSampler(sampler, tools=tools, environment_factory=environment_factory,
                       max_turns=config.max_turns, tool_timeout_s=config.tool_timeout_s,
                       max_tool_chars=config.max_tool_chars)
