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


def test_it_refuses_bad_settings(tiny_model, tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="base_url='127.0.0.1:8000' must be the server's http"):
        VLLMServerSampler(tiny_model, tokenizer, base_url="127.0.0.1:8000")
    with pytest.raises(TypeError, match=r"unknown settings \['enforce_eager'\]; .*server's command line"):
        VLLMServerSampler(tiny_model, tokenizer, base_url="http://x", enforce_eager=True)
    with pytest.raises(ValueError, match="lora_sync='full' must be 'adapter'"):
        VLLMServerSampler(tiny_model, tokenizer, base_url="http://x", lora_sync="full")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="under torchrun with 2 ranks"):
        VLLMServerSampler(tiny_model, tokenizer, base_url="http://x")


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
