"""VLLMServerSampler's checks, against a stand-in HTTP server on 127.0.0.1 that answers like a vLLM server
started without the needed options (the sampler with a real server: tests/vllm/test_vllm_server.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from grpo_engine.sampling.vllm_server import VLLMServerSampler, server_command
from grpo_engine.types import Prompt

PROMPTS = [Prompt("2+2?", "4")]


def stand_in(logprobs_mode: str | None):
    """A server listing one model of max_model_len 4096; /server_info only when ``logprobs_mode`` is given;
    every other path 404 (as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING / VLLM_SERVER_DEV_MODE)."""

    class Handler(BaseHTTPRequestHandler):
        def answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path == "/v1/models":
                self.answer(200, {"data": [{"id": "policy", "max_model_len": 4096}]})
            elif self.path.startswith("/server_info") and logprobs_mode is not None:
                self.answer(200, {"vllm_config": {"model_config": {"logprobs_mode": logprobs_mode}}})
            else:
                self.answer(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer(404, {"detail": "Not Found"})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_it_refuses_bad_settings(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="base_url='127.0.0.1:8000' must be the server's http"):
        VLLMServerSampler(tiny_model, tokenizer, base_url="127.0.0.1:8000")
    with pytest.raises(TypeError, match=r"unknown settings \['enforce_eager'\]; .*server's command line"):
        VLLMServerSampler(tiny_model, tokenizer, base_url="http://x", enforce_eager=True)
    with pytest.raises(ValueError, match="lora_sync='full' must be 'adapter'"):
        VLLMServerSampler(tiny_model, tokenizer, base_url="http://x", lora_sync="full")


def test_a_server_without_the_needed_options_is_named_with_the_fix(tiny_model, tokenizer):
    server, url = stand_in("raw_logprobs")
    try:
        with pytest.raises(ValueError, match="returns raw_logprobs log-probs; restart it with "
                                             "--logprobs-mode processed_logprobs"):
            VLLMServerSampler(tiny_model, tokenizer, base_url=url).sample(PROMPTS, group_size=2)
    finally:
        server.shutdown()
    server, url = stand_in(None)
    try:
        sampler = VLLMServerSampler(tiny_model, tokenizer, base_url=url)
        # no development endpoints: the logprobs mode cannot be checked, and full weights cannot be reloaded
        with pytest.warns(UserWarning, match="cannot read the logprobs mode"), \
                pytest.raises(RuntimeError, match="/collective_rpc with HTTP 404.*VLLM_SERVER_DEV_MODE=1"):
            sampler.sample(PROMPTS, group_size=2)
        sampler.close()
        assert not sampler.sync_dir.exists()
    finally:
        server.shutdown()


def test_the_server_command_serves_what_the_sampler_needs():
    argv, env = server_command("m", port=8001, max_lora_rank=16, full_weights=True, python="python",
                               extra=["--enforce-eager"])
    line = " ".join(argv)
    assert line.startswith("python -m vllm.entrypoints.openai.api_server --model m --host 127.0.0.1 "
                           "--port 8001")
    assert "--logprobs-mode processed_logprobs" in line and "--enable-lora --max-lora-rank 16" in line
    assert argv[-1] == "--enforce-eager"
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    argv, env = server_command("m", max_lora_rank=None)
    assert "--enable-lora" not in argv and env == {}


def test_a_fused_adamw_step_makes_the_next_sample_sync(tiny_model, tokenizer):
    """torch's fused AdamW moves no version counter: the sampler counts optimizer steps over the policy too,
    and not those of another model's optimizer."""
    sampler = VLLMServerSampler(tiny_model, tokenizer, base_url="http://127.0.0.1:1")
    synced = []
    sampler._sync_weights = lambda: synced.append(1)
    assert sampler.sync() > 0 and len(synced) == 1
    assert sampler.sync() == 0.0 and len(synced) == 1  # nothing changed
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    torch.optim.AdamW(other.parameters(), fused=True).step()
    assert sampler.sync() == 0.0 and len(synced) == 1  # another model's step
    params = [p for p in tiny_model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    versions = [p._version for p in params]
    torch.optim.AdamW(params, lr=0.1, fused=True).step()
    assert [p._version for p in params] == versions  # the fused kernel moved no counter
    sampler.sync()
    assert len(synced) == 2
    sampler.close()


def recording_server(fail: bool = False):
    """A stand-in that answers every POST (404 to everything when ``fail``) and records (path, body)."""
    seen: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            data = b'{"detail": "Not Found"}' if fail else b'"Success"'
            self.send_response(404 if fail else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", seen


class Rank:
    """One rank of a 2-rank launch: its broadcasts hand back what rank 0 sent (``told``, for rank 1)."""

    def __init__(self, rank: int, told=None):
        self.rank, self.told, self.is_main = rank, told, rank == 0

    def broadcast(self, obj):
        return obj if self.rank == 0 else self.told


def adapter_sampler(tokenizer, url: str, rank: Rank, run: str | None = None) -> VLLMServerSampler:
    """A sampler of a LoRA policy as rank ``rank`` of a launch whose run (rank 0's) is ``run``."""
    from peft import LoraConfig, get_peft_model

    from tests.tiny import tiny_llama

    model = get_peft_model(tiny_llama(len(tokenizer)), LoraConfig(r=2, target_modules=["q_proj"]))
    sampler = VLLMServerSampler(model, tokenizer, base_url=url)
    sampler.lora, sampler.world = True, rank  # what the first sample() reads from the launch
    sampler._run = run or sampler._run
    return sampler


def test_under_torchrun_rank_0_alone_changes_the_shared_server_and_every_rank_names_its_adapter(tokenizer):
    server, url, seen = recording_server()
    try:
        first = adapter_sampler(tokenizer, url, Rank(0))
        second = adapter_sampler(tokenizer, url, Rank(1), run=first._run)
        other_run = adapter_sampler(tokenizer, url, Rank(0))  # another trainer on the same server
        for sampler in (first, second):
            sampler.sync()
        assert [(path, body["lora_name"]) for path, body in seen] == [
            ("/v1/load_lora_adapter", f"{first._run}-1")]  # rank 1 asked the server nothing
        assert second._model_name() == first._model_name() == f"{first._run}-1"
        with torch.no_grad():  # a training step moves the policy on both ranks
            for sampler in (first, second):
                next(p for p in sampler.model.parameters() if p.requires_grad).add_(1.0)
        seen.clear()
        for sampler in (first, second):
            sampler.sync()
        # the new adapter is loaded before the old one goes (every rank's requests with it ended)
        assert [(path, body["lora_name"]) for path, body in seen] == [
            ("/v1/load_lora_adapter", f"{first._run}-2"), ("/v1/unload_lora_adapter", f"{first._run}-1")]
        assert second._model_name() == f"{first._run}-2"
        other_run.sync()
        assert seen[-1][1]["lora_name"] == f"{other_run._run}-1" != f"{first._run}-1"
        seen.clear()
        second.close()
        assert not seen  # rank 0 unloads the adapter every rank used
        first.close()
        assert seen == [("/v1/unload_lora_adapter", {"lora_name": f"{first._run}-2"})]
        other_run.close()
    finally:
        server.shutdown()


def test_a_sync_rank_0_could_not_make_stops_every_rank_with_its_reason(tokenizer):
    server, url, seen = recording_server(fail=True)
    try:
        first = adapter_sampler(tokenizer, url, Rank(0))
        with pytest.raises(RuntimeError, match="/v1/load_lora_adapter with HTTP 404"):
            first.sync()
        told = "RuntimeError: the vLLM server at http://x answered /v1/load_lora_adapter with HTTP 404"
        second = adapter_sampler(tokenizer, url, Rank(1, told=told), run=first._run)
        with pytest.raises(RuntimeError, match="rank 0 could not sync the policy to the vLLM server at "
                                               "http://127.0.0.1:.*so this rank stops too: RuntimeError: "
                                               "the vLLM server at http://x answered"):
            second.sync()
        assert len(seen) == 1  # rank 0's one try
        first.close(), second.close()
    finally:
        server.shutdown()
