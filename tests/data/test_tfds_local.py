"""Building the suite or GSM8K leaves nothing in the system temp folder (tfds' GCS lookup did)."""

import json
import tempfile

import pytest

from joyagents_jax.data import assistant_suite, gsm8k


@pytest.fixture
def temp_folder(tmp_path, monkeypatch):
    folder = tmp_path / "system_tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_building_the_suite_leaves_no_temp_folder(temp_folder, tmp_path):
    sources = assistant_suite.load_suite("tiny", data_dir=tmp_path / "data")
    assert len(sources["train"]) > 0
    assert list(temp_folder.iterdir()) == []


def test_building_gsm8k_leaves_no_temp_folder(temp_folder, tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    row = {"question": "Ann has 3 pens and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"}
    for name in gsm8k.REQUIRED_FILES:
        (manual / name).write_text(json.dumps(row) + "\n")
    sources = gsm8k.load_gsm8k(manual, tmp_path / "data")
    assert len(sources["test"]) == 1
    assert list(temp_folder.iterdir()) == []
