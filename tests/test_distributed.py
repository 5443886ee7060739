"""Data parallel on the CPU (gloo): 2 torchrun ranks x B/2 prompts train exactly like 1 process x B.

Both runs sample the same completions (token draws keyed by the global row), so their gradients,
weights and metrics must agree to float32 summation order: each case below fails if a count, a
batch statistic, the gradient sum or a metric were per rank instead of the whole step's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_engine.distributed import World
from grpo_engine.types import Prompt, RewardOutput, Rollout, RolloutBatch, StepRollout
from tests import _dp_run

CASES = ["sequence", "token", "constant", "batch_std", "reinforce_pp", "kl_reward", "curriculum", "dynamic",
         "demo", "top_entropy", "fsdp_lora", "fsdp_full", "fsdp_top_entropy", "tools"]
TWO_RANKS_ONLY = ["dynamic_top_entropy"]  # checked against what its ranks recorded, not against one process
WORKER = Path(_dp_run.__file__)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(two-rank folder, one-process folder), each with every case run (_dp_run.steps_of)."""
    root = tmp_path_factory.mktemp("dp")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), str(root / "two"), *CASES, *TWO_RANKS_ONLY]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in CASES:
        _dp_run.run(case, root / "one")
    return root / "two", root / "one"


def load(folder: Path, case: str, file: str = "rank0.pt") -> dict:
    return torch.load(folder / case / file)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_the_gradients_weights_and_metrics_of_one_process(runs, case):
    two, one = (load(folder, case) for folder in runs)
    assert len(two["grads"]) == len(one["grads"]) >= 2
    for step, (g2, g1) in enumerate(zip(two["grads"], one["grads"])):
        assert max(float(g.abs().max()) for g in g1) > 1e-4, (f"step {step + 1}: nothing trained, "
                                                               "a vacuous check")
        assert max_diff(g2, g1) < 1e-6, f"step {step + 1}: gradients differ"
    for w2, w1 in zip(two["weights"], one["weights"]):
        assert max_diff(w2, w1) < 1e-6
    for m2, m1 in zip(two["metrics"], one["metrics"], strict=True):
        assert m2.keys() == m1.keys()
        for key in m1:
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("case", ["sequence", "demo", "fsdp_lora", "fsdp_full", "dynamic_top_entropy"])
def test_every_rank_holds_the_same_weights_and_metrics(runs, case):
    rank0, rank1 = load(runs[0], case), load(runs[0], case, "rank1.pt")
    assert max_diff(rank0["weights"][-1], rank1["weights"][-1]) == 0.0
    assert rank0["metrics"] == rank1["metrics"]


def test_the_tools_run_called_tools_across_turns(runs):
    """The tools case's equality means something only if its rollouts took several turns."""
    one = load(runs[1], "tools")
    assert all(m["tools/calls"] > 0 and m["turns/mean"] > 1 for m in one["metrics"])


def test_the_demo_run_had_signal_to_train_on(runs):
    """The demo case's equality means something only if its steps moved the policy."""
    one = load(runs[1], "demo")
    assert any(m["zero_std_fraction"] < 1.0 for m in one["metrics"])
    assert one["metrics"][-1]["lr"] < one["metrics"][0]["lr"]  # the cosine schedule ran


@pytest.mark.parametrize("case", ["sequence", "fsdp_lora", "fsdp_full", "tools"])
def test_a_two_rank_checkpoint_resumes_in_one_process_and_continues_equally(runs, case):
    two, one = runs
    resumed = _dp_run.run(case, two, resume=str(two / case / "checkpoint-1"))
    reference = load(one, case)
    assert len(resumed["weights"]) == 1  # step 2 only
    assert max_diff(resumed["grads"][0], reference["grads"][1]) < 1e-6
    assert max_diff(resumed["weights"][0], reference["weights"][1]) < 1e-6
    for key, value in reference["metrics"][1].items():
        assert resumed["metrics"][0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_an_fsdp_checkpoint_holds_one_optimizer_shard_per_rank(runs):
    """The weights are one ordinary model file; the optimizer state is torch.distributed.checkpoint's
    shards (one file per rank), nothing of it in trainer_state.pt."""
    folder = runs[0] / "fsdp_full" / "checkpoint-1"
    assert sorted(p.name for p in (folder / "optimizer").iterdir()) == [".metadata", "__0_0.distcp",
                                                                       "__1_0.distcp"]
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    assert state["optimizer"] is None and state["optimizer_format"] == "dcp"
    assert (folder / "model.safetensors").is_file()
    plain = torch.load(runs[1] / "fsdp_full" / "checkpoint-1" / "trainer_state.pt", weights_only=False)
    assert plain["optimizer_format"] == "state_dict" and plain["optimizer"]["state"]  # one process: as before


def test_checkpoints_reshard_onto_two_fsdp_ranks(runs, tmp_path):
    """Onto 2 sharded ranks: a 2-rank FSDP2 checkpoint (its optimizer shards loaded through
    torch.distributed.checkpoint) and a one-process one (its whole optimizer state, keyed by position,
    cut into shards by parameter name). Both continue as the uninterrupted one-process run."""
    import shutil

    two, one = runs
    shutil.copytree(two / "fsdp_full", tmp_path / "fsdp_full")
    shutil.copytree(one / "fsdp_lora", tmp_path / "fsdp_lora")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), str(tmp_path), "fsdp_full", "fsdp_lora", "--resume-step", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in ("fsdp_full", "fsdp_lora"):
        resumed, reference = load(tmp_path, case, "resumed-rank0.pt"), load(one, case)
        assert max_diff(resumed["grads"][0], reference["grads"][1]) < 1e-6, case
        assert max_diff(resumed["weights"][0], reference["weights"][1]) < 1e-6, case
        for key, value in reference["metrics"][1].items():
            assert resumed["metrics"][0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (case, key)


def test_fsdp_refuses_what_it_cannot_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(World, "current", classmethod(lambda cls: cls(rank=0, size=2)))
    tokenizer = _dp_run.char_tokenizer()
    with pytest.raises(ValueError, match=r"sharding='fsdp' does not take optimizer='adamw8bit'"):
        _dp_run.GRPOTrainer(_dp_run.tiny_llama(len(tokenizer)), [_dp_run.DigitShare()],
                            [_dp_run.Prompt("1+1=", "2"), _dp_run.Prompt("1+2=", "3")],
                            _dp_run.GRPOConfig(prompts_per_step=2, output_dir=str(tmp_path)),
                            tokenizer=tokenizer,
                            memory=_dp_run.MemoryPlan(sharding="fsdp", optimizer="adamw8bit"))


def test_fsdp_on_a_torch_without_sum_only_fsdp2_says_so(monkeypatch):
    """No process group is needed: the check comes before any sharding."""
    from torch.distributed.fsdp import FSDPModule

    from grpo_engine.distributed import fully_shard_model

    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(RuntimeError, match=r"sharding='fsdp' needs FSDP2 .* lacks; install a newer torch, "
                                           r"or use sharding='none'"):
        fully_shard_model(_dp_run.tiny_llama(8))


def test_prompts_per_step_must_split_evenly_across_ranks():
    with pytest.raises(ValueError, match=r"prompts_per_step=6 does not split across 4 processes"
                                         r".*e\.g\. 4 or 8"):
        World(rank=0, size=4).check_prompts_per_step(6)
    World(rank=1, size=2).check_prompts_per_step(6)


def _rollout(groups: int, first: int, marks: list[bool] | None = None) -> Rollout:
    """``groups`` groups of 2 one-token rows, their rows numbered from ``first``."""
    n = 2 * groups
    ids = torch.arange(first, first + n)[:, None]
    ones = torch.ones(n, 1, dtype=torch.bool)
    batch = RolloutBatch(tuple(Prompt(f"p{i}") for i in range(groups)), 2, ids, ones, ids, ones,
                         torch.zeros(n, dtype=torch.bool), tuple(str(i) for i in range(n)),
                         trained_groups=torch.tensor(marks) if marks is not None else None)
    return Rollout(batch, RewardOutput(torch.zeros(groups, 2)))


def test_each_rank_takes_its_slice_in_rank_order_and_its_rows_of_the_whole_step():
    assert World(rank=1, size=2).share(["a", "b", "c", "d"]) == (["c", "d"], 2)
    # the first len % K ranks: one more
    assert World(rank=0, size=2).share(["a", "b", "c"]) == (["a", "b"], 0)
    assert World(rank=1, size=2).share(["a", "b", "c"]) == (["c"], 2)
    # rank 0 drew 2 groups (rows 0-3), rank 1 one group (rows 4-5); a filter kept groups 1 and 2
    local, whole = _rollout(1, 4, [True]), Rollout.concat([_rollout(2, 0, [False, True]),
                                                           _rollout(1, 4, [True])])
    step = StepRollout(local, whole, groups_per_rank=(2, 1), rank=1)
    assert step.local_rows(torch.arange(6)).tolist() == [4, 5]
    kept = step.trained()
    assert kept.groups_per_rank == (1, 1) and kept.whole.batch.prompt_ids.flatten().tolist() == [2, 3, 4, 5]
    assert kept.local_rows(kept.whole.batch.prompt_ids.flatten()).tolist() == [4, 5]


def test_dynamic_sampling_took_extra_rounds_and_dropped_groups(runs):
    """The dynamic case's equality covers the rounds only if there were some."""
    metrics = load(runs[0], "dynamic")["metrics"]
    assert max(m["dynamic_sampling/rounds"] for m in metrics) >= 2
    assert any(m["dynamic_sampling/groups_sampled"] > m["dynamic_sampling/groups_kept"] for m in metrics)


def test_the_top_entropy_threshold_is_over_every_ranks_ith_micro_batch(runs):
    """DynamicSampling leaves the ranks unequal rows, so unequal micro-batch counts (micro-batch 2). The
    i-th micro-batch's pool on every rank is rank 0's i-th valid entropies then rank 1's (nothing from a
    rank without an i-th): a rank with fewer micro-batches still joins every gather."""
    pools = [load(runs[0], "dynamic_top_entropy", f"rank{r}.pt")["pools"] for r in (0, 1)]
    assert len(pools[0]) == len(pools[1]) == _dp_run.steps_of("dynamic_top_entropy")
    unequal = moved = False
    for mine, theirs in zip(*pools, strict=True):
        unequal |= len(mine) != len(theirs)
        for i in range(max(len(mine), len(theirs))):
            want = torch.cat([rank[i][0] for rank in (mine, theirs) if i < len(rank)])
            for rank in (mine, theirs):
                if i < len(rank):
                    local, pool = rank[i]
                    assert torch.equal(pool, want), f"micro-batch {i}"
                    moved |= bool(torch.quantile(local, 0.8) != torch.quantile(pool, 0.8))
    assert unequal and moved  # both situations occurred, so the checks above meant something


def test_fsdp_refuses_a_group_filter(tmp_path, monkeypatch):
    from grpo_engine.sampling.dynamic import DynamicSampling

    monkeypatch.setattr(World, "current", classmethod(lambda cls: cls(rank=0, size=2)))
    tokenizer = _dp_run.char_tokenizer()
    with pytest.raises(ValueError, match="sharding='fsdp' does not take a sampler that drops groups"):
        _dp_run.GRPOTrainer(_dp_run.tiny_llama(len(tokenizer)), [_dp_run.DigitShare()],
                            [_dp_run.Prompt("1+1=", "2"), _dp_run.Prompt("1+2=", "3")],
                            _dp_run.GRPOConfig(prompts_per_step=2, output_dir=str(tmp_path)),
                            tokenizer=tokenizer, sampler=DynamicSampling(),
                            memory=_dp_run.MemoryPlan(sharding="fsdp"))


RUN_FILE = """
model: {model}
train_prompts: {{function: grpo_engine.data.load_jsonl_prompts, path: {data}, question_field: q,
                answer_field: a}}
rewards:
  - {{class: grpo_engine.rewards.MathAccuracy, isolate: false}}
  - {{class: tests._dp_run.DigitShare, weight: 0.5}}
template: {{class: grpo_engine.data.PlainTemplate, format: "{{question}}="}}
config: {{prompts_per_step: 4, group_size: 3, max_completion_tokens: 6, max_steps: 2, learning_rate: 3.0e-4,
          output_dir: {out}, progress_bar: false}}
memory: {{lora: {{r: 2, alpha: 4}}, micro_batch_size: 4}}
imports: [tests]
"""


def test_grpo_engine_train_under_torchrun_logs_once_and_trains_like_one_process(tmp_path):
    import json

    from safetensors.torch import load_file

    from grpo_engine.cli import main
    from tests.tiny import char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a}+{a}", "a": str(2 * a)}) + "\n" for a in range(10, 20)))
    for name in ("two", "one"):
        (tmp_path / f"{name}.yaml").write_text(RUN_FILE.format(model=tmp_path / "model", data=data,
                                                               out=tmp_path / name))
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "grpo_engine.cli", "train", str(tmp_path / "two.yaml")]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("saved to") == 1  # rank 0 speaks
    assert main(["train", str(tmp_path / "one.yaml")]) == 0

    def lines(name):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "tokens/generated_"))}
                for row in rows]

    two, one = lines("two"), lines("one")
    assert [row["step"] for row in two] == [1, 2]  # one line per step: rank 0 alone writes
    for row2, row1 in zip(two, one, strict=True):
        assert row2.keys() == row1.keys()
        for key in row1:
            assert row2[key] == pytest.approx(row1[key], rel=1e-5, abs=1e-6), key
    adapters = [load_file(tmp_path / name / "final" / "adapter_model.safetensors") for name in ("two", "one")]
    assert max(float((adapters[0][k] - adapters[1][k]).abs().max()) for k in adapters[1]) < 1e-6


def test_plan_predicts_one_rank_of_a_data_parallel_run(capsys):
    from grpo_engine.cli import main
    from grpo_engine.memory.estimate import Workload

    assert main(["plan", "--model", "qwen2.5-0.5b", "--budget-gib", "24", "--prompts-per-step", "8",
                 "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "2 prompts x 8 completions" in out and "per rank (4 ranks, sharding none)" in out
    assert Workload(prompts_per_step=8).per_rank(4) == Workload(prompts_per_step=2)
    with pytest.raises(ValueError, match="prompts_per_step=8 does not split across ranks=3"):
        Workload(prompts_per_step=8).per_rank(3)


def test_fsdp_memory_per_rank_shards_all_but_the_head():
    """Hand arithmetic: 1/K of every parameter but one vocab x hidden matrix, for weights, gradients and
    AdamW states; the rest of the model comes back while sampling."""
    from grpo_engine.memory.estimate import KNOWN_SHAPES, Workload, estimate_memory
    from grpo_engine.memory.plan import MemoryPlan

    s, work = KNOWN_SHAPES["qwen2.5-1.5b"], Workload(prompts_per_step=2, group_size=8)
    plan = MemoryPlan(dtype="bfloat16", sharding="fsdp")
    one, four = estimate_memory(s, plan, work), estimate_memory(s, plan, work, ranks=4)
    head = s.vocab * s.hidden
    assert four.parts["weights"] == ((s.num_params - head) / 4 + head) * 2
    assert four.parts["optimizer_state"] == four.parts["gradients"] * 2 == four.parts["weights"] * 2
    assert four.parts["weights"] + four.parts["gathered_weights"] == one.parts["weights"] == s.num_params * 2
    assert four.phases["optimizer"] < one.phases["optimizer"] / 2
    none = estimate_memory(s, plan.model_copy(update={"sharding": "none"}), work, ranks=4)
    assert none.parts == one.parts  # data parallel: every rank holds the whole model
