"""GSM8K from local jsonl files: parsing, missing-file errors, and the numeric answer checker."""

import json

import pytest

from joyagents_jax.data import gsm8k

_ROWS = [
    {"question": "Ann has 3 pens and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A bill of 1,200 is split in 2.", "answer": "1,200 / 2 = 600\n#### 600"},
]


def _write(directory, name, rows):
    (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def manual_dir(tmp_path):
    directory = tmp_path / "manual"
    directory.mkdir()
    _write(directory, "train.jsonl", _ROWS)
    _write(directory, "test.jsonl", _ROWS[:1])
    return directory


def test_reads_local_files(manual_dir, tmp_path):
    sources = gsm8k.load_gsm8k(manual_dir, tmp_path / "data")
    assert {k: len(v) for k, v in sources.items()} == {"train": 2, "test": 1}
    records = sorted((sources["train"][i] for i in range(2)), key=lambda r: r["question"])
    assert records[0]["short_answer"] == b"600"
    assert records[0]["annotation"] == b"1,200 / 2 = 600"
    assert records[1]["answer"].decode() == _ROWS[0]["answer"]


def test_optional_socratic_split(manual_dir, tmp_path):
    _write(manual_dir, "test_socratic.jsonl", _ROWS)
    sources = gsm8k.load_gsm8k(manual_dir, tmp_path / "data")
    assert set(sources) == {"train", "test", "test_socratic"}


def test_missing_files_are_named(manual_dir, tmp_path):
    (manual_dir / "test.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing from .*manual: test\.jsonl\. Put"):
        gsm8k.load_gsm8k(manual_dir, tmp_path / "data")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl, test\.jsonl\. Put"):
        gsm8k.load_gsm8k(tmp_path / "nowhere", tmp_path / "data")


def test_malformed_line_is_located(manual_dir, tmp_path):
    _write(manual_dir, "train.jsonl", [{"question": "Q?", "answer": "no final line"}])
    with pytest.raises(ValueError, match=r"train\.jsonl:1: expected JSON"):
        gsm8k.load_gsm8k(manual_dir, tmp_path / "data")


@pytest.mark.parametrize("text, expected", [
    ("so 3 + 4 = 7\n#### 7", "7"), ("#### 1,200", "1200"), ("#### -3.5", "-3.5"),
    ("The answer is 18.", "18"), ("I got $1,234.50 in total", "1234.50"), ("no number", None),
    ("5 apples, then 6\n#### 11 apples", "11"),
])
def test_extract_answer(text, expected):
    assert gsm8k.extract_answer(text) == expected


@pytest.mark.parametrize("prediction, reference, correct", [
    ("The answer is 600.", "1,200 / 2 = 600\n#### 600", True),
    ("600.00", "#### 600", True), ("1,200", "#### 1200", True), ("601", "#### 600", False),
    ("I don't know", "#### 600", False), ("#### 7", "7", True),
])
def test_is_correct(prediction, reference, correct):
    assert gsm8k.is_correct(prediction, reference) is correct


@pytest.mark.parametrize("multi_agent, agents", [(False, ["master"]),
                                                 (True, ["master", "math", "master"])])
def test_suite_view_gold_replays_to_full_reward(manual_dir, tmp_path, multi_agent, agents):
    from joyagents_jax.agents import system
    from joyagents_jax.data import assistant_suite as suite

    _write(manual_dir, "train.jsonl", _ROWS + [
        {"question": "Is 3 < 4? Add them.", "answer": "3 < 4, and 3 + 4 = <<3+4=7>>7\n#### 7"}])
    views = gsm8k.as_suite(manual_dir, tmp_path / "data", multi_agent=multi_agent)
    assert {k: len(v) for k, v in views.items()} == {"train": 3, "test": 1}
    sys_ = system.make_system(None, agents=["math"] if multi_agent else [])
    for i in range(3):
        ex = suite.decode(views["train"][i])
        assert (ex.domain, ex.answer_kind, ex.question_id) == ("math", "number", f"gsm8k-train-{i}")
        assert [n.agent for n in ex.gold] == agents and ex.min_llm_calls == len(agents)
        assert "<<" not in ex.gold[-1 if not multi_agent else 1].output
        episode = system.demonstration(sys_, ex.query, [n.output for n in ex.gold])
        parts = episode.reward(ex.answer, ex.answer_kind, ex.min_llm_calls)
        assert episode.done and parts.r_answer == 1.0 and parts.r_efficiency == 0.0
        assert all(n.wellformed for n in episode.nodes)
