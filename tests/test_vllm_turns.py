"""The vLLM samplers' multi-turn requests without vLLM: each row's settings (its seed keyed by its place,
its budget, stop texts kept in the output, EOS ids), the mapping of vLLM's finish reasons to
``Turn.ended``, the server's requests through a stand-in HTTP server, and tools over a vLLM sampler (the
engines themselves: tests/vllm/test_vllm_turns.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_engine import GRPOConfig
from grpo_engine.sampling.turns import Turn, TurnGenerator
from grpo_engine.sampling.vllm_server import VLLMServerSampler
from grpo_engine.sampling.vllm_turns import as_turn, turn_requests
from grpo_engine.tools.rollout import ToolSampler, with_tools

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def requests(**overrides):
    settings = dict(max_new_tokens=[5, 1], places=[3, 8], temperature=0.7, seed=2**31 - 4,
                    stop_texts=["</call>"], top_p=0.9, top_k=0, eos_ids=[1, 7])
    return turn_requests([[4, 5], [6]], **{**settings, **overrides})


def test_each_row_asks_for_one_draw_keyed_by_its_place_with_its_budget():
    first, second = requests()
    # seeds: (2**31 - 4 + 3) % 2**31 = 2**31 - 1 and (2**31 - 4 + 8) % 2**31 = 4: the place, not the index
    assert (first["seed"], second["seed"]) == (2**31 - 1, 4)
    assert (first["max_tokens"], second["max_tokens"]) == (5, 1)
    assert first == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 5, "logprobs": 0,
                     "seed": 2**31 - 1, "stop": ["</call>"], "include_stop_str_in_output": True,
                     "stop_token_ids": [1, 7], "skip_special_tokens": False}
    assert requests(top_k=20)[0]["top_k"] == 20
    # a row's request does not depend on the rows beside it
    alone = turn_requests([[6]], max_new_tokens=[1], places=[8], temperature=0.7, seed=2**31 - 4,
                          stop_texts=["</call>"], top_p=0.9, top_k=0, eos_ids=[1, 7])
    assert alone == [second]


def test_bad_turn_arguments_are_named_with_the_fix():
    with pytest.raises(ValueError, match="2 contexts, 1 max_new_tokens and 2 places; pass one of each"):
        requests(max_new_tokens=[5])
    with pytest.raises(ValueError, match="row 1's max_new_tokens=0 must be >= 1"):
        requests(max_new_tokens=[5, 0])
    with pytest.raises(ValueError, match=r"stop_texts=\['</call>', ''\] holds an empty text"):
        requests(stop_texts=["</call>", ""])
    with pytest.raises(ValueError, match="row 0's context is empty"):
        turn_requests([[]], max_new_tokens=[1], places=[0], temperature=1.0, seed=0, stop_texts=[],
                      top_p=1.0, top_k=0, eos_ids=[1])


def test_vllms_finish_reasons_become_the_turns_end():
    # an EOS ends it even when it also completed a stop text (vLLM: finish "stop", stop_reason None or the id)
    assert as_turn([5, 1], [-0.5, -0.25], finish_reason="stop", stop_reason=None, eos_ids=[1, 7]) == Turn(
        (5, 1), (-0.5, -0.25), "eos")
    assert as_turn([5, 7], [-0.5, -0.25], finish_reason="stop", stop_reason=7, eos_ids=[1, 7]).ended == "eos"
    assert as_turn([5, 7], [-1.0, -2.0], finish_reason="stop", stop_reason="</call>",
                   eos_ids=[1, 7]).ended == "eos"
    # a stop text matched at the last token of the budget: vLLM reports the stop text, and so do we
    assert as_turn([5, 6], [-1.0, -2.0], finish_reason="stop", stop_reason="</call>",
                   eos_ids=[1]).ended == "stop"
    assert as_turn([5, 6], [-1.0, -2.0], finish_reason="length", stop_reason=None,
                   eos_ids=[1]).ended == "length"
    with pytest.raises(RuntimeError, match="2 token ids with 1 log-probs"):
        as_turn([5, 6], [-1.0], finish_reason="length", stop_reason=None, eos_ids=[1])
    with pytest.raises(RuntimeError, match="finish_reason='stop', stop_reason=None.*neither an EOS id"):
        as_turn([5, 6], [-1.0, -2.0], finish_reason="stop", stop_reason=None, eos_ids=[1])


def stand_in(bodies: list[dict]):
    """A server that serves a model with processed log-probs, accepts weight reloads, and answers each
    completion request (recorded in ``bodies``) with the prompt's last id + 1, then + 2, and the finish
    reasons of the prompt's length: 1 EOS (id 1), 2 a stop text, else the budget."""

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path == "/v1/models":
                self.answer({"data": [{"id": "policy", "max_model_len": 4096}]})
            else:
                self.answer({"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                return self.answer({})
            bodies.append(body)
            last, kind = body["prompt"][-1], len(body["prompt"])
            ids = [last + 1, 1] if kind == 1 else [last + 1, last + 2]
            reason = {1: ("stop", None), 2: ("stop", "</call>")}.get(kind, ("length", None))
            self.answer({"choices": [{"index": 0, "token_ids": ids,
                                      "logprobs": {"token_logprobs": [-0.5, -1.5]},
                                      "finish_reason": reason[0], "stop_reason": reason[1]}]})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_the_server_sampler_sends_each_context_as_its_ids_and_reads_back_turns(tiny_model, tokenizer):
    bodies: list[dict] = []
    server, url = stand_in(bodies)
    try:
        sampler = VLLMServerSampler(tiny_model, tokenizer, base_url=url, top_k=5)
        assert isinstance(sampler, TurnGenerator)
        turns = sampler.generate_turn([[9], [9, 10], [9, 10, 11]], max_new_tokens=[2, 4, 2], places=[0, 5, 6],
                                      temperature=0.5, seed=100, stop_texts=["</call>"])
        assert sampler.last_sync_seconds > 0  # the first turn synced the (fully fine-tuned) policy
        again = sampler.generate_turn([[9]], max_new_tokens=[2], places=[0], temperature=0.5, seed=100,
                                      stop_texts=["</call>"])
        assert sampler.last_sync_seconds == 0.0  # nothing changed since: no sync at the next turn
        sampler.close()
    finally:
        server.shutdown()
    assert turns == [Turn((10, 1), (-0.5, -1.5), "eos"), Turn((11, 12), (-0.5, -1.5), "stop"),
                     Turn((12, 13), (-0.5, -1.5), "length")]
    assert again == turns[:1]
    by_prompt = {tuple(b["prompt"]): b for b in bodies}
    assert by_prompt[(9, 10)] == {"model": "policy", "prompt": [9, 10], "n": 1, "temperature": 0.5,
                                  "top_p": 1.0, "top_k": 5, "max_tokens": 4, "logprobs": 0, "seed": 105,
                                  "stop": ["</call>"], "include_stop_str_in_output": True,
                                  "stop_token_ids": sampler.eos_ids, "skip_special_tokens": False,
                                  "return_token_ids": True}
    assert by_prompt[(9, 10, 11)]["seed"] == 106


def test_tools_wrap_a_vllm_sampler_which_generates_each_turn(tiny_model, tokenizer):
    tokenizer.chat_template = TEMPLATE

    def echo(x: str) -> str:
        """Says back what it got.

        Args:
            x: any text.
        """
        return x

    sampler = VLLMServerSampler(tiny_model, tokenizer, base_url="http://127.0.0.1:1")
    wrapped = with_tools(sampler, [echo], None, GRPOConfig())
    assert isinstance(wrapped, ToolSampler) and wrapped.base is sampler
    assert isinstance(wrapped.base, TurnGenerator)
    sampler.close()
