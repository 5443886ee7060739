"""Tests for grpo_engine.data: loaders, the synthetic task, templates and the prompt stream."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from grpo_engine.data import (
    ChatTemplate,
    DataError,
    PlainTemplate,
    Prompt,
    PromptStream,
    PromptTemplate,
    arithmetic_task,
    default_template,
    gsm8k_final_answer,
    load_gsm8k,
    load_jsonl_prompts,
    load_math500,
)
from tests.tiny import char_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- loaders


def test_jsonl_custom_fields_metadata_and_line_numbers(tmp_path):
    path = write(
        tmp_path / "qa.jsonl",
        '{"q": "What is 1+1?", "a": 2, "id": "x1"}',
        "",
        '{"q": "Name a prime.", "a": "7", "id": "x2", "level": 3}',
    )
    prompts = load_jsonl_prompts(path, question_field="q", answer_field="a")
    assert prompts == [
        Prompt("What is 1+1?", "2", {"id": "x1", "source": str(path), "line": 1}),
        Prompt("Name a prime.", "7", {"id": "x2", "level": 3, "source": str(path), "line": 3}),
    ]
    shouted = load_jsonl_prompts(
        path, question_field="q", answer_field="a", answer_fn=lambda a: a + "!"
    )
    assert [p.target for p in shouted] == ["2!", "7!"]
    no_target = load_jsonl_prompts(path, question_field="q", answer_field=None, limit=1)
    assert no_target == [
        Prompt("What is 1+1?", None, {"a": 2, "id": "x1", "source": str(path), "line": 1})
    ]


def test_json_list_file(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(
        json.dumps([{"question": "A?", "answer": "1"}, {"question": "B?", "answer": 2.5}])
    )
    assert load_jsonl_prompts(path) == [
        Prompt("A?", "1", {"source": str(path), "index": 0}),
        Prompt("B?", "2.5", {"source": str(path), "index": 1}),
    ]


def test_missing_answer_names_file_line_fields_and_fix(tmp_path):
    path = write(
        tmp_path / "m.jsonl",
        '{"question": "A?", "answer": "1"}',
        '{"question": "B?", "solution": "2"}',
    )
    with pytest.raises(DataError) as err:
        load_jsonl_prompts(path)
    assert str(err.value) == (
        f"{path}:2: no 'answer' field (fields present: ['question', 'solution']); "
        "pass answer_field=... to name the field holding the reference answer"
    )
    with pytest.raises(
        DataError, match="pass question_field=... to name the field holding the question"
    ):
        load_jsonl_prompts(path, question_field="problem")


def test_bad_json_line_names_file_line_and_reason(tmp_path):
    path = write(tmp_path / "bad.jsonl", '{"question": "A?", "answer": "1"}', "{oops")
    with pytest.raises(DataError) as err:
        load_jsonl_prompts(path)
    reason = "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    assert str(err.value) == f"{path}:2: not valid JSON ({reason})"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "", "answer": "1"}', "'question' must be a non-empty string, got ''"),
        ('{"question": 3, "answer": "1"}', "'question' must be a non-empty string, got 3"),
        (
            '{"question": "A?", "answer": null}',
            "'answer' is null (fields present: ['question', 'answer'])",
        ),
        ('["A?", "1"]', "expected a JSON object, got list"),
    ],
)
def test_bad_records(tmp_path, line, message):
    path = write(tmp_path / "r.jsonl", line)
    with pytest.raises(DataError) as err:
        load_jsonl_prompts(path)
    assert str(err.value).startswith(f"{path}:1: {message}")


def test_missing_empty_files_and_bad_limit(tmp_path):
    with pytest.raises(DataError, match=r"data file not found: .*nope\.jsonl \(resolved to "):
        load_jsonl_prompts(tmp_path / "nope.jsonl")
    empty = write(tmp_path / "empty.jsonl", "", "  ")
    with pytest.raises(DataError) as err:
        load_jsonl_prompts(empty)
    assert str(err.value) == f"{empty}: no records found (empty file or empty list); check the path"
    with pytest.raises(
        DataError, match=r"^limit=0 must be a positive int, or None to read every record$"
    ):
        load_jsonl_prompts(
            write(tmp_path / "one.jsonl", '{"question": "A?", "answer": 1}'), limit=0
        )


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18", "18"),
        ("80,000+50,000=$<<80000+50000=130000>>130,000\n####   70,000  \n", "70000"),
        ("#### 1,234,567", "1234567"),
        ("a #### b\n#### -3", "-3"),
        ("####0.5", "0.5"),
    ],
)
def test_gsm8k_final_answer(solution, expected):
    assert gsm8k_final_answer(solution) == expected


def test_gsm8k_final_answer_without_marker():
    with pytest.raises(DataError) as err:
        gsm8k_final_answer("So the answer is 5.")
    assert str(err.value) == (
        "GSM8K solution has no '####' final-answer marker: 'So the answer is 5.'; "
        "pass the 'answer' field of an openai/grade-school-math record"
    )


def test_load_gsm8k_local_file(tmp_path):
    rows = [
        {"question": "Q1?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
        {"question": "Q2?", "answer": "1,000 + 200 = 1,200\n#### 1,200"},
    ]
    path = write(tmp_path / "gsm.jsonl", *(json.dumps(r) for r in rows))
    assert load_gsm8k(path) == [
        Prompt("Q1?", "4", {"solution": rows[0]["answer"], "source": str(path), "line": 1}),
        Prompt("Q2?", "1200", {"solution": rows[1]["answer"], "source": str(path), "line": 2}),
    ]
    bad = write(tmp_path / "bad.jsonl", '{"question": "Q?", "answer": "no marker"}')
    with pytest.raises(
        DataError, match=r"bad\.jsonl:1: GSM8K solution has no '####' final-answer marker"
    ):
        load_gsm8k(bad)


def test_load_gsm8k_shared_test_file():
    path = SHARED_DATA / "gsm8k" / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    prompts = load_gsm8k(path, limit=5)
    assert [p.target for p in prompts] == ["18", "3", "70000", "540", "20"]
    assert prompts[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert [p.metadata["line"] for p in prompts] == [1, 2, 3, 4, 5]
    assert prompts[2].metadata["solution"].endswith("\n#### 70000")


def test_load_gsm8k_hub_builds_same_prompts_and_offline_error(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [
            {"question": "Q?", "answer": "x\n#### 1,000"},
            {"question": "R?", "answer": "#### 2"},
        ]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    source = "openai/gsm8k:main/test"
    assert load_gsm8k(split="test", limit=1) == [
        Prompt("Q?", "1000", {"solution": "x\n#### 1,000", "source": source, "index": 0})
    ]
    assert calls == [("openai/gsm8k", "main", "test")]

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DataError) as err:
        load_gsm8k()
    assert str(err.value) == (
        "could not load GSM8K split 'train' from the hub (ConnectionError: no network); "
        "when offline, pass the local file: load_gsm8k('path/to/gsm8k/test.jsonl')"
    )


def test_load_math500(tmp_path):
    row = {
        "problem": "P?",
        "solution": "\\boxed{\\frac12}",
        "answer": "\\frac12",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "t/1.json",
    }
    path = write(tmp_path / "m.jsonl", json.dumps(row))
    meta = {
        "solution": "\\boxed{\\frac12}",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "t/1.json",
    }
    assert load_math500(path) == [
        Prompt("P?", "\\frac12", {**meta, "source": str(path), "line": 1})
    ]
    shared = SHARED_DATA / "math500" / "test.jsonl"
    if shared.is_file():
        first = load_math500(shared, limit=1)[0]
        assert first.target == "\\left( 3, \\frac{\\pi}{2} \\right)"
        assert first.metadata["unique_id"] == "test/precalculus/807.json"


# ---------------------------------------------------------------- synthetic task

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def test_arithmetic_task_targets_ranges_and_questions():
    train, test = arithmetic_task(300, 100, seed=3, ops=("+", "-", "*"))
    assert (len(train), len(test)) == (300, 100)
    for p in train + test:
        a, op, b = p.metadata["a"], p.metadata["op"], p.metadata["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert p.question == f"What is {a} {op} {b}?"
        assert p.target == str(OPS[op](a, b))
    assert {p.metadata["op"] for p in train} == {"+", "-", "*"}
    assert any(p.target.startswith("-") for p in train)


def test_arithmetic_task_deterministic_disjoint_and_unique():
    def triples(prompts):
        return [(p.metadata["a"], p.metadata["op"], p.metadata["b"]) for p in prompts]

    train, test = arithmetic_task(500, 200, seed=7)
    assert arithmetic_task(500, 200, seed=7) == (train, test)
    assert triples(arithmetic_task(500, 200, seed=8)[0]) != triples(train)
    assert len(set(triples(train))) == 500 and len(set(triples(test))) == 200
    assert not set(triples(train)) & set(triples(test))
    # digits=1 has 2 * 9 * 9 = 162 problems; asking for all of them returns each exactly once
    small_train, small_test = arithmetic_task(100, 62, digits=1)
    assert len(set(triples(small_train + small_test))) == 162


def test_arithmetic_task_templates_vary_phrasing():
    train, _ = arithmetic_task(
        40, 0, ops=("*",), question=["{a} times {b}?", "Compute {a}{op}{b}."]
    )
    a, b = train[0].metadata["a"], train[0].metadata["b"]
    assert {p.question.startswith("Compute") for p in train} == {True, False}
    assert train[0].question in {f"{a} times {b}?", f"Compute {a}*{b}."}


def test_arithmetic_task_errors():
    with pytest.raises(DataError) as err:
        arithmetic_task(100, 63, digits=1)
    assert str(err.value) == (
        "num_train + num_test = 100 + 63 = 163 exceeds the 162 distinct problems with digits=1 "
        "and ops=('+', '-'); ask for fewer, or raise digits or add ops"
    )
    with pytest.raises(
        DataError, match=r"ops=\('/',\) must be a non-empty sequence of distinct operators"
    ):
        arithmetic_task(1, 1, ops=("/",))
    with pytest.raises(
        DataError, match=r"uses the fields \['a', 'c'\]; it must use \{a\} and \{b\}"
    ):
        arithmetic_task(1, 1, question="{a} and {c}")
    with pytest.raises(DataError, match=r"^num_test=-1 must be an int >= 0$"):
        arithmetic_task(1, -1)


def test_comparison_task_asks_for_the_largest_or_smallest_of_distinct_numbers():
    from grpo_engine.data.synthetic import comparison_task

    train, test = comparison_task(300, 100, seed=3)
    assert comparison_task(300, 100, seed=3) == (train, test)
    keys = [(p.metadata["numbers"], p.metadata["kind"]) for p in train + test]
    assert len(set(keys)) == 400  # no problem twice, none in both splits
    for p in train + test:
        numbers, kind = p.metadata["numbers"], p.metadata["kind"]
        assert len(set(numbers)) == 3 and all(10 <= n <= 99 for n in numbers)
        assert p.target == str(max(numbers) if kind == "largest" else min(numbers))
        assert p.question == f"Which is the {kind} of {numbers[0]}, {numbers[1]} and {numbers[2]}?"
    assert {p.metadata["kind"] for p in train} == {"largest", "smallest"}
    # count=2, digits=1, largest only: 9 * 8 = 72 problems; asking for all returns each once
    small = comparison_task(70, 2, count=2, digits=1, kinds=("largest",))
    assert len({p.metadata["numbers"] for p in small[0] + small[1]}) == 72
    with pytest.raises(DataError, match="exceeds the 72 distinct problems"):
        comparison_task(70, 3, count=2, digits=1, kinds=("largest",))
    with pytest.raises(DataError, match=r"count=1 must be an int from 2 to 9"):
        comparison_task(1, 1, count=1)
    with pytest.raises(DataError, match=r"kinds=\('middle',\) must be a non-empty sequence"):
        comparison_task(1, 1, kinds=("middle",))


# ---------------------------------------------------------------- templates


def test_chat_template_renders_with_tokenizer_chat_template(tokenizer):
    template = ChatTemplate(system="Be brief.", instruction=" Answer in digits.")
    assert isinstance(template, PromptTemplate)
    assert template.render(Prompt("What is 2+2?"), tokenizer) == (
        "<system>Be brief.\n<user>What is 2+2? Answer in digits.\n<assistant>"
    )
    chat = Prompt(
        (
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"},
            {"role": "user", "content": "1+1?"},
        )
    )
    assert (
        template.render(chat, tokenizer)
        == "<system>Be brief.\n<user>Hi\n<assistant>Yo\n<user>1+1?\n<assistant>"
    )
    own_system = Prompt(
        ({"role": "system", "content": "Mine."}, {"role": "user", "content": "1+1?"})
    )
    assert template.render(own_system, tokenizer) == "<system>Mine.\n<user>1+1?\n<assistant>"
    assert ChatTemplate().render(Prompt("Q"), tokenizer) == "<user>Q\n<assistant>"


def test_chat_template_without_chat_template_suggests_plain():
    base = char_tokenizer(chat=False)
    with pytest.raises(DataError) as err:
        ChatTemplate().render(Prompt("Q"), base)
    assert str(err.value) == (
        f"{type(base).__name__} has no chat template (tokenizer.chat_template is None), so "
        "ChatTemplate cannot render; use PlainTemplate() (or default_template(tokenizer)) for a "
        "base model, or set tokenizer.chat_template"
    )


def test_plain_template_and_default_template(tokenizer):
    assert (
        PlainTemplate().render(Prompt("What is 2+2?"), tokenizer)
        == "Question: What is 2+2?\nAnswer:"
    )
    assert PlainTemplate("Q: {question} A:").render(Prompt("x {y}"), None) == "Q: x {y} A:"
    with pytest.raises(
        DataError, match=r"uses the fields \[\]; it must use \{question\} and no other field"
    ):
        PlainTemplate("Question: {{question}}")
    with pytest.raises(DataError, match=r"uses the fields \['answer', 'question'\]"):
        PlainTemplate("{question} {answer}")
    assert default_template(tokenizer, system="S", instruction="!") == ChatTemplate(
        system="S", instruction="!"
    )
    plain = default_template(
        char_tokenizer(chat=False), system="Use {braces}.", instruction=" Be brief."
    )
    assert plain == PlainTemplate("Use {{braces}}.\n\nQuestion: {question} Be brief.\nAnswer:")
    assert (
        plain.render(Prompt("1+1?"), None) == "Use {braces}.\n\nQuestion: 1+1? Be brief.\nAnswer:"
    )
    assert hash(ChatTemplate("S")) == hash(ChatTemplate("S"))
    assert repr(PlainTemplate("{question}")) == "PlainTemplate(format='{question}')"


# ---------------------------------------------------------------- stream


def questions(batches):
    return [p.question for batch in batches for p in batch]


def test_stream_serves_every_prompt_once_per_epoch():
    prompts = [Prompt(f"p{i}") for i in range(10)]
    stream = PromptStream(prompts, batch_size=4, seed=0)
    batches = [stream.next_batch() for _ in range(5)]  # 20 prompts = exactly 2 epochs
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4]
    served = questions(batches)
    all_ = sorted(f"p{i}" for i in range(10))
    assert sorted(served[:10]) == all_ and sorted(served[10:]) == all_
    assert served[:10] != served[10:]  # a fresh permutation each epoch
    assert (stream.epoch, stream.position) == (1, 10)
    stream.next_batch()
    assert (stream.epoch, stream.position) == (2, 4)


def test_stream_deterministic_per_seed_and_batch_larger_than_data():
    prompts = [Prompt(f"p{i}") for i in range(10)]

    def first_batches(seed):
        stream = PromptStream(prompts, batch_size=3, seed=seed)
        return questions(stream.next_batch() for _ in range(7))

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)
    assert sorted(first_batches(1)[:10]) == sorted(p.question for p in prompts)
    big = PromptStream(prompts[:3], batch_size=7, seed=0).next_batch()
    assert len(big) == 7 and sorted(p.question for p in big[:3]) == ["p0", "p1", "p2"]


def test_stream_resume_continues_exactly():
    prompts = [Prompt(f"p{i}") for i in range(7)]
    original = PromptStream(prompts, batch_size=3, seed=5)
    for _ in range(3):
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))
    assert state == {"seed": 5, "epoch": 1, "position": 2, "num_prompts": 7}
    resumed = PromptStream(prompts, batch_size=3, seed=5)
    resumed.load_state_dict(state)
    assert questions(resumed.next_batch() for _ in range(6)) == questions(
        original.next_batch() for _ in range(6)
    )
    with pytest.raises(
        DataError, match=r"^state_dict seed=5 but this PromptStream has seed=6; build"
    ):
        PromptStream(prompts, batch_size=3, seed=6).load_state_dict(state)


def test_stream_errors():
    with pytest.raises(DataError, match="^PromptStream got no prompts; pass a non-empty list"):
        PromptStream([], batch_size=2)
    with pytest.raises(
        DataError, match=r"^batch_size=0 must be an int >= 1 \(the prompts per step, B\)$"
    ):
        PromptStream([Prompt("a")], batch_size=0)
