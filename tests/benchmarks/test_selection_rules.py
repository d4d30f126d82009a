"""The selection rules' pure helpers: candidates, the choice, the table."""

import importlib.util
import json
import pathlib

from joyagents_jax import selection

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "selection_rules.py"
_SPEC = importlib.util.spec_from_file_location("selection_rules", _PATH)
sr = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sr)


def test_candidates_are_the_scored_steps_and_the_last():
    assert sr.candidates([2, 4, 6, 8, 10], 4, 10) == [4, 8, 10]
    assert sr.candidates([2, 4, 6, 8, 10], 2, 10) == [2, 4, 6, 8, 10]


def test_choose_takes_the_best_slice_score_and_the_latest_on_ties():
    answers = {2: [1, 1, 0, 0], 4: [1, 0, 0, 0], 6: [1, 1, 1, 0], 8: [0, 1, 1, 0]}
    assert sr.choose(answers, [0, 1, 2, 3], 2, 8) == 6
    assert sr.choose(answers, [1, 2], 4, 8) == 8  # 4: 0, 8: 2 (tie with 6, not a candidate)
    assert sr.choose(answers, [1, 2], 2, 8) == 8  # 6 and 8 tie at 2: the latest
    assert sr.choose(answers, [0], 2, 8) == 6


def _run(seed, test, train, num_train=6):
    rows = sorted(set(selection.slice_rows(num_train, 2)) | set(selection.slice_rows(num_train,
                                                                                       4)))
    return {"seed": seed, "num_train": num_train, "rows": rows, "last": max(test),
            "test": test, "train": {s: [train[s][i] for i in rows] for s in train}}


def test_rule_table_rows_for_the_last_step_the_oracle_and_each_rule(tmp_path):
    train = {2: [1] * 6, 4: [0] * 6}  # every rule prefers step 2 (4 is the last)
    run = _run(0, {2: [1, 1, 0, 0], 4: [1, 0, 0, 1]}, train)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(run))  # step keys become strings, as on disk
    loaded = sr.load(str(path))
    assert loaded["test"] == run["test"] and loaded["train"] == run["train"]
    table = sr.rule_table([loaded], [(2, 2), (4, 4)]).splitlines()
    assert table[2] == "| the last step | 4 | 0.500 | 0.500 | 0 / 0 (1.000) |"
    assert table[3] == "| the best test step (oracle) | 4 | 0.500 | 0.500 | 0 / 0 (1.000) |"
    assert table[4] == "| every 2, 2 records | 2 | 0.500 | 0.500 | 1 / 1 (1.000) |"
    assert table[5] == "| every 4, 4 records | 4 | 0.500 | 0.500 | 0 / 0 (1.000) |"


def test_sign_p():
    assert sr.sign_p(0, 0) == 1.0
    assert abs(sr.sign_p(12, 3) - 0.0352) < 1e-3
