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
