"""A tiny seeded training run for the kill-and-resume tests (run as a subprocess).

    python tests/_resume_run.py OUT MAX_STEPS [--kill-after K | --kill-in-save K] [--resume]
"""

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import grpo_engine.checkpoint as checkpoint  # noqa: E402
from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan  # noqa: E402
from grpo_engine.callbacks import Callback  # noqa: E402
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare  # noqa: E402
from tests.tiny import char_tokenizer, tiny_llama  # noqa: E402


class KillAfterSave(Callback):
    def __init__(self, step):
        self.step = step

    def on_save(self, trainer, state, control, *, path):
        if path.name == f"checkpoint-{self.step}":
            os.kill(os.getpid(), signal.SIGKILL)  # a crash right after the checkpoint is on disk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kill_in_save:
        fsync = checkpoint._fsync_tree

        def dying_fsync(folder):  # every file of the checkpoint written, the rename not yet done
            fsync(folder)
            if f"checkpoint-{args.kill_in_save}-" in folder.name:
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint._fsync_tree = dying_fsync
    tok = char_tokenizer()
    config = GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=args.max_steps,
                        learning_rate=5e-2, lr_schedule="cosine", save_every_steps=2, output_dir=args.out,
                        progress_bar=False, seed=7)
    callbacks = [KillAfterSave(args.kill_after)]  # always: a resumed run needs the same callbacks
    trainer = GRPOTrainer(tiny_llama(len(tok), seed=7), [DigitShare()], PROMPTS, config,
                          MemoryPlan(lora=LoRA(r=4, alpha=8), micro_batch_size=4), tokenizer=tok,
                          template=TEMPLATE, callbacks=callbacks,
                          resume_from="latest" if args.resume else None)
    trainer.train()
    print("resumed from", trainer.resumed_from)


if __name__ == "__main__":
    main()
