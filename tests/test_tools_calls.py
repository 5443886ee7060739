"""Tools as users write them: ``async def`` tools awaited (and cancelled at their limit), one environment's
methods never at the same time (a tool that detects overlap), and a timed-out call's late result, error or
waiting call never applied; a rollout whose environment's call timed out ends there."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from grpo_engine.sampling.hf import HFSampler
from grpo_engine.tools import ToolSampler, as_tool, call_tools, environment_tools
from grpo_engine.tools.functions import reset_environment
from grpo_engine.types import Draws, Prompt
from tests.test_tools import TEMPLATE, turn_taking_model
from tests.tiny import char_tokenizer


async def double(x: int) -> int:
    """Doubles x, after a pause.

    Args:
        x: a number.
    """
    await asyncio.sleep(0.01)
    return 2 * x


class Probe:
    """An environment whose methods notice when another of its methods runs at the same time."""

    def __init__(self) -> None:
        self.active, self.overlaps, self.total, self.log = 0, 0, 0, []
        self._guard = threading.Lock()

    async def reset(self, target: str) -> str:
        await asyncio.sleep(0)
        self.target = target
        return f" (reach {target})"

    def _enter(self) -> None:
        with self._guard:
            self.active += 1
            self.overlaps += self.active > 1

    def _leave(self) -> None:
        with self._guard:
            self.active -= 1

    def add(self, n: int) -> int:
        """Adds n, slowly.

        Args:
            n: how much.
        """
        self._enter()
        time.sleep(0.05)
        self.total += n
        self.log.append(n)
        self._leave()
        return self.total

    async def aadd(self, n: int) -> int:
        """Adds n, slowly, as a coroutine.

        Args:
            n: how much.
        """
        self._enter()
        try:
            await asyncio.sleep(0.05)
            self.total += n
            self.log.append(n)
            return self.total
        finally:
            self._leave()

    def stuck(self, seconds: float) -> str:
        """Sleeps, then adds 100 and fails.

        Args:
            seconds: how long.
        """
        self._enter()
        time.sleep(seconds)
        self.total += 100
        self._leave()
        raise RuntimeError("a late error")

    async def astuck(self, seconds: float) -> str:
        """Sleeps as a coroutine, then adds 100.

        Args:
            seconds: how long.
        """
        await asyncio.sleep(seconds)
        self.total += 100
        return "late"


def tools_of(env):
    return {t.name: t for t in environment_tools(env)}


def test_an_async_tool_an_async_method_and_an_async_reset_are_awaited():
    env = Probe()
    assert reset_environment(env, Prompt("q", target="7")) == " (reach 7)" and env.target == "7"
    tools = {"double": as_tool(double), **tools_of(env)}
    [results] = call_tools([(tools, [{"name": "double", "arguments": {"x": 21}},
                                     {"name": "aadd", "arguments": {"n": 5}}])], timeout_s=2.0, max_chars=100)
    assert [(r.status, r.content) for r in results] == [("ok", "42"), ("ok", "5")]


def test_an_async_call_past_its_limit_is_cancelled_for_real_and_its_environment_is_free_again():
    env = Probe()
    tools = tools_of(env)
    [[late]] = call_tools([(tools, [{"name": "astuck", "arguments": {"seconds": 0.5}}])], timeout_s=0.1,
                          max_chars=100)
    assert late.status == "timeout"
    time.sleep(0.05)  # the cancellation has landed: the lock is free, the rest of the coroutine never ran
    [[after]] = call_tools([(tools, [{"name": "add", "arguments": {"n": 1}}])], timeout_s=1.0, max_chars=100)
    assert after.content == "1"
    time.sleep(0.6)
    assert env.total == 1


@pytest.mark.parametrize("method", ["add", "aadd"])
def test_one_environments_methods_never_overlap_even_when_rows_share_it(method):
    shared = Probe()  # an environment_factory that hands the same object to every rollout
    rows = [(tools_of(shared), [{"name": method, "arguments": {"n": k}}] * 2) for k in range(4)]
    results = call_tools(rows, timeout_s=5.0, max_chars=100, workers=4)
    assert all(r.status == "ok" for row in results for r in row)
    assert shared.overlaps == 0 and sorted(shared.log) == [0, 0, 1, 1, 2, 2, 3, 3] and shared.total == 12
    # the probe does see overlap: the same calls without the environment's lock
    unlocked = Probe()
    rows = [({n: dataclasses.replace(t, lock=None) for n, t in tools_of(unlocked).items()},
             [{"name": method, "arguments": {"n": k}}]) for k in range(4)]
    call_tools(rows, timeout_s=5.0, max_chars=100, workers=4)
    assert unlocked.overlaps > 0


def test_a_timed_out_calls_late_error_is_dropped_and_no_waiting_call_runs_after_it(monkeypatch):
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    env = Probe()
    tools = tools_of(env)
    start = time.perf_counter()
    [first] = call_tools([(tools, [{"name": "stuck", "arguments": {"seconds": 1.0}},
                                   {"name": "add", "arguments": {"n": 1}}])], timeout_s=0.1, max_chars=100)
    # the row's later call is not made: its environment is still busy with the timed-out one
    assert [r.status for r in first] == ["timeout", "error"] and "not run" in first[1].content
    # another row of the same environment waits for it within its own limit, then is given up
    [[waited]] = call_tools([(tools, [{"name": "add", "arguments": {"n": 1}}])], timeout_s=0.1, max_chars=100)
    assert waited.status == "timeout" and time.perf_counter() - start < 0.9
    time.sleep(max(1.2 - (time.perf_counter() - start), 0.0))
    # the stuck call has ended (its own side effect is its own: +100), nothing else ran
    assert env.total == 100 and env.log == [] and env.overlaps == 0
    assert raised == []  # its late error went nowhere
    [[fresh]] = call_tools([(tools, [{"name": "add", "arguments": {"n": 1}}])], timeout_s=1.0, max_chars=100)
    assert (fresh.status, fresh.content) == ("ok", "101")  # its own result, not the late one


def test_reset_refuses_an_environment_still_busy_with_a_timed_out_call():
    env = Probe()
    call_tools([(tools_of(env), [{"name": "stuck", "arguments": {"seconds": 1.0}}])], timeout_s=0.05,
               max_chars=100)
    with pytest.raises(RuntimeError, match="still busy"):
        reset_environment(env, Prompt("q", target="1"), timeout_s=0.05)
    time.sleep(1.1)
    assert reset_environment(env, Prompt("q", target="1"), timeout_s=0.05) == " (reach 1)"


class Hangs:
    """An environment whose one method outlives the tool time limit."""

    def reset(self) -> None:
        self.calls = 0

    def wait(self, n: int) -> int:
        """Waits.

        Args:
            n: ignored.
        """
        self.calls += 1
        time.sleep(0.4)
        return n


class CallsWait:
    stop_text = None

    def parse(self, text):
        return [{"name": "wait", "arguments": {"n": 1}}, {"name": "wait", "arguments": {"n": 2}}]

    def system_prompt(self, schemas):
        return "tools: wait"


def test_a_rollout_whose_environments_call_timed_out_ends_there():
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    sampler = ToolSampler(HFSampler(turn_taking_model(tok), tok, max_completion_tokens=256),
                          environment_factory=Hangs, parser=CallsWait(), max_turns=3, tool_timeout_s=0.1)
    batch = sampler.sample([Prompt("1+1?")], group_size=2, temperature=1.0, draws=Draws(seed=1))
    assert batch.metrics["turns/ended_by_timeout"] == 2 and batch.metrics["tools/timeouts"] == 2
    assert batch.metrics["ends/tool_timeout"] == 2 and batch.is_truncated.all()
    for i, episode in enumerate(batch.episodes):
        assert episode.turns == 1 and episode.end == "tool_timeout"  # no turn after the timeout
        replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert "did not return within 0.1 s" in replies[0] and "not run" in replies[1]
        # the replies stand in the tokens as in the messages, after the model's only turn, never trained on
        env = batch.env_mask[i] & batch.completion_mask[i]
        assert tok.decode(batch.completion_ids[i][env]) == "".join(
            f"\n<tool>{r}<eos>" for r in replies) + "\n<assistant>"
        env = batch.env_mask[i][batch.completion_mask[i]]
        first = int(env.nonzero()[0])
        assert not env[:first].any() and env[first:].all()  # the model's turn, then the replies to the end
    time.sleep(0.45)
    assert [e.environment.calls for e in batch.episodes] == [1, 1]  # the second call was never made
