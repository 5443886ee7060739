"""Data for GRPO: file loaders (JSON/JSONL, GSM8K, MATH-500), ``to_prompts`` (a ``datasets.Dataset``
or a list of dicts), a synthetic arithmetic task,
prompt templates (chat or plain text), and the prompt sources: a seeded, resumable stream of prompt
batches and an online curriculum.

Example:
    >>> from grpo_engine.data import PromptStream, arithmetic_task
    >>> train, test = arithmetic_task(num_train=8, num_test=4, seed=0)
    >>> len(PromptStream(train, batch_size=4, seed=0).next_batch())
    4
"""

from grpo_engine.data.curriculum import InformativeCurriculum, PromptStats
from grpo_engine.data.errors import DataError
from grpo_engine.data.loaders import (
    gsm8k_final_answer,
    load_gsm8k,
    load_jsonl_prompts,
    load_math500,
)
from grpo_engine.data.records import to_prompts
from grpo_engine.data.stream import EpochOrder, PromptStream
from grpo_engine.data.synthetic import arithmetic_task
from grpo_engine.data.templates import (
    ChatTemplate,
    PlainTemplate,
    PromptTemplate,
    default_template,
)
from grpo_engine.types import Prompt

__all__ = [
    "ChatTemplate",
    "DataError",
    "EpochOrder",
    "InformativeCurriculum",
    "PlainTemplate",
    "Prompt",
    "PromptStats",
    "PromptStream",
    "PromptTemplate",
    "arithmetic_task",
    "default_template",
    "gsm8k_final_answer",
    "load_gsm8k",
    "load_jsonl_prompts",
    "load_math500",
    "to_prompts",
]
