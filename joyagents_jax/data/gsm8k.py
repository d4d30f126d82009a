"""GSM8K from local files: the tfds catalog builder, reading jsonl files the user supplies.

The catalog's `gsm8k` builder downloads from GitHub; this subclass (`gsm8k_local`) keeps its
features and reads `train.jsonl` and `test.jsonl` (plus the optional `*_socratic.jsonl`) from a
manual directory instead, so no network is needed. Each line is `{"question", "answer"}` with the
answer's last line `#### N`. `extract_answer` and `is_correct` are the numeric answer checker. `as_suite` reads a split as
assistant-suite records (with a gold trajectory for the single- or the multi-agent system), so
the training pipeline runs on GSM8K unchanged.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.text.gsm8k import gsm8k

from joyagents_jax.data import tfds_local

REQUIRED_FILES = ("train.jsonl", "test.jsonl")
OPTIONAL_FILES = ("train_socratic.jsonl", "test_socratic.jsonl")
_SOURCE = "https://github.com/openai/grade-school-math (grade_school_math/data/)"
_CALC = re.compile(r"<<[^<>]*>>")  # the solutions' calculator annotations, e.g. <<48/2=24>>
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final number of a solution: after the last '####', else the last number in `text`."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    return (numbers[0] if "####" in text else numbers[-1]).replace(",", "")


def parse_number(text: str) -> float | None:
    """`text` as a number, ignoring thousands separators, '$' and a trailing '.'; else None."""
    cleaned = text.strip().replace(",", "").lstrip("$").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def is_correct(prediction: str, reference: str, tolerance: float = 1e-6) -> bool:
    """Whether the final number of `prediction` equals the reference answer ('#### N' or N)."""
    pred, ref = extract_answer(prediction), extract_answer(reference)
    if pred is None or ref is None:
        return False
    a, b = parse_number(pred), parse_number(ref)
    return a is not None and b is not None and abs(a - b) <= tolerance * max(1.0, abs(b))


def local_files(manual_dir: str | os.PathLike) -> dict[str, epath.Path]:
    """Split name -> jsonl path in `manual_dir`; FileNotFoundError names missing required files."""
    root = epath.Path(manual_dir)
    missing = [name for name in REQUIRED_FILES if not (root / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"GSM8K files missing from {root}: {', '.join(missing)}. Put "
            f"{', '.join(REQUIRED_FILES)} (optionally {', '.join(OPTIONAL_FILES)}) there, "
            f"from {_SOURCE}.")
    names = REQUIRED_FILES + tuple(n for n in OPTIONAL_FILES if (root / n).exists())
    return {name.removesuffix(".jsonl"): root / name for name in names}


class Gsm8kLocal(gsm8k.Gsm8k):
    """The catalog GSM8K builder, reading the user's jsonl files from the manual directory."""

    name = "gsm8k_local"
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Download {', '.join(REQUIRED_FILES + OPTIONAL_FILES)} from {_SOURCE} into the manual "
        "directory (`manual_dir` of `load_gsm8k`, or tfds' DownloadConfig.manual_dir).")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds_local.built_here(super()._info())

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        return {split: self._generate_examples(path)
                for split, path in local_files(dl_manager.manual_dir).items()}

    def _generate_examples(self, path: epath.PathLike):
        with epath.Path(path).open() as f:
            for i, line in enumerate(f):
                if line.strip():
                    yield i, _example(line, f"{path}:{i + 1}")


def _example(line: str, where: str) -> dict[str, str]:
    """The catalog's features of one jsonl line, with a clear error for a malformed one."""
    try:
        row = json.loads(line)
        annotation, short_answer = row["answer"].rsplit("####", 1)
        return {"question": row["question"], "answer": row["answer"],
                "annotation": annotation.strip(), "short_answer": short_answer.strip()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: expected JSON with 'question' and an 'answer' ending in "
                         f"'#### N' ({e})") from None


def load_gsm8k(manual_dir: str | os.PathLike,
               data_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Random-access data sources of the local GSM8K splits; prepares them on first use."""
    builder = Gsm8kLocal(data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        local_files(manual_dir)  # fail before tfds does, naming the expected files
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir)))
    return builder.as_data_source()


def gold_outputs(annotation: str, short_answer: str, multi_agent: bool) -> list[str]:
    """The gold trajectory's node outputs for one problem.

    Single agent: the master reasons and answers alone. Multi agent: the master hands the
    problem to the math sub-agent, which gives the same reasoning and answer, and the master
    repeats it; the reasoning content is equal, so the comparison isolates the hierarchy.
    """
    reasoning = _CALC.sub("", annotation).replace("<", " less than ").replace(">", " more than ")
    solve = f"<think>{' '.join(reasoning.split())}</think><answer>{short_answer}</answer>"
    if not multi_agent:
        return [solve]
    return ['<call agent="math"/>', solve, f"<answer>{short_answer}</answer>"]


class SuiteView:
    """A GSM8K split read as assistant-suite records (domain math, numeric answer, gold
    trajectory): `assistant_suite.decode` turns them into `Example`s."""

    def __init__(self, source, split: str, multi_agent: bool):
        self.source, self.split, self.multi_agent = source, split, multi_agent

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = {k: v.decode() if isinstance(v, bytes) else str(v)
               for k, v in self.source[i].items()}
        outputs = gold_outputs(row["annotation"], row["short_answer"], self.multi_agent)
        agents = ["master", "math", "master"] if self.multi_agent else ["master"]
        gold = [{"agent": a, "output": o} for a, o in zip(agents, outputs)]
        return {"query": row["question"], "domain": "math", "answer": row["short_answer"],
                "answer_kind": "number", "min_llm_calls": len(gold),
                "question_id": f"gsm8k-{self.split}-{i}", "gold": json.dumps(gold)}


def as_suite(manual_dir: str | os.PathLike, data_dir: str | os.PathLike | None,
             multi_agent: bool) -> dict[str, SuiteView]:
    """Every local GSM8K split as assistant-suite records; see `SuiteView`."""
    return {split: SuiteView(source, split, multi_agent)
            for split, source in load_gsm8k(manual_dir, data_dir).items()}
