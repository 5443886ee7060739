"""One optimizer step's gradient, end to end: ours against TRL's ``GRPOTrainer`` on the same completions.

``tests/test_trl_parity.py`` checks the losses on identical log-prob tensors; this test runs the whole
training pass of both engines through the same LoRA-wrapped model: left-padded prompts of two lengths,
completions that end at EOS and one cut at the limit, group z-score advantages, token-mean aggregation
(TRL's ``loss_type="dapo"``), two micro-batches accumulated (TRL's ``gradient_accumulation_steps=2``).
Ours runs :class:`~grpo_engine.gradients.PolicyGradient` (the trainer's stage 5, with the prompt shared
across its group or not); TRL runs ``compute_loss`` on the batch its generation step would have built.
The LoRA gradients must agree to float32 rounding: at identical settings the two engines make the same
update from the same batch. Whether they learn alike over a whole run, where each samples its own
batches, is what ``benchmarks/learning.py --steps`` measures.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_engine import ClippedSurrogate, GroupNormalized, MemoryPlan
from grpo_engine.distributed import DataParallel
from grpo_engine.gradients import PolicyGradient
from grpo_engine.types import Prompt, RolloutBatch
from grpo_engine.world import World
from tests.tiny import char_tokenizer, tiny_llama

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

G, C = 4, 7
PROMPTS = ["What is 12 + 7?", "Compute 3-1"]  # two lengths: the second is left-padded
LENGTHS = [3, 7, 5, 2, 7, 4, 6, 1]  # completion lengths; 7 = C is cut at the limit, the others end at EOS
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.5]]


def _batch(tok) -> RolloutBatch:
    enc = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, enc))
    padded = [[tok.pad_token_id] * (width - len(e)) + e for e in enc]
    prompt_ids = torch.tensor(padded).repeat_interleave(G, 0)
    lengths = torch.tensor(LENGTHS)
    mask = torch.arange(C)[None] < lengths[:, None]
    ids = torch.randint(4, len(tok), (2 * G, C), generator=torch.Generator().manual_seed(1))
    truncated = lengths == C
    rows = torch.arange(2 * G)[~truncated]
    ids[rows, lengths[~truncated] - 1] = tok.eos_token_id
    return RolloutBatch(prompts=tuple(Prompt(p) for p in PROMPTS), group_size=G, prompt_ids=prompt_ids,
                        prompt_mask=prompt_ids != tok.pad_token_id, completion_ids=ids.masked_fill(~mask, 0),
                        completion_mask=mask, is_truncated=truncated, texts=("",) * (2 * G))


def _trl_gradients(model, tok, batch: RolloutBatch, advantages, tmp_path) -> None:
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=G,
                          gradient_accumulation_steps=2, max_completion_length=C, loss_type="dapo", beta=0.0,
                          temperature=1.0, top_k=0, report_to="none", use_cpu=True, bf16=False, fp16=False,
                          gradient_checkpointing=False)
    trainer = trl.GRPOTrainer(model, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                              processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # what TRL's training loop sets
    tokens = batch.completion_mask.sum()  # TRL's num_items_in_batch: the whole generation batch's tokens
    for rows in (slice(0, G), slice(G, 2 * G)):  # two micro-batches, accumulated
        inputs = dict(prompt_ids=batch.prompt_ids[rows], prompt_mask=batch.prompt_mask[rows].long(),
                      completion_ids=batch.completion_ids[rows],
                      completion_mask=batch.completion_mask[rows].long(), advantages=advantages[rows],
                      num_items_in_batch=tokens, old_per_token_logps=None, ref_per_token_logps=None)
        trainer.compute_loss(trainer.model, inputs).backward()


@pytest.mark.parametrize("share_prompt", [True, False])
def test_one_steps_lora_gradient_equals_trls(share_prompt, tmp_path):
    tok = char_tokenizer()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                           task_type="CAUSAL_LM", init_lora_weights=False)  # B != 0: every LoRA weight learns
    torch.manual_seed(0)
    ours = peft.get_peft_model(tiny_llama(len(tok), hidden=64), lora)
    theirs = copy.deepcopy(ours)
    batch = _batch(tok)
    advantages = GroupNormalized(eps=1e-4)(torch.tensor(REWARDS)).reshape(-1)
    PolicyGradient(ours, ClippedSurrogate(aggregation="token"),
                   MemoryPlan(micro_batch_size=G, share_prompt=share_prompt), DataParallel(World()),
                   log_entropy=False)(batch, advantages, temperature=1.0)
    _trl_gradients(theirs, tok, batch, advantages, tmp_path)
    got = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and len(got) == 28  # A and B of 7 linear layers x 2 decoder layers
    for name in got:
        assert want[name].norm() > 0, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
