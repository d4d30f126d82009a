"""The fingerprint's pure helpers: which values it hashes and where two runs part."""

import importlib.util
import json
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fingerprint.py"
_SPEC = importlib.util.spec_from_file_location("fingerprint", _PATH)
fp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fp)

ROWS = [{"step": 1, "phase": "sft", "time": 10.0, "sft/loss/master": 5.5},
        {"step": 2, "phase": "grpo", "rollout/seconds": 3.1, "grpo/reward": 0.25,
         "rollout/tokens_per_second": 900.0}]


def test_numbers_leave_out_wall_clock_values_only():
    assert fp.numbers(ROWS) == [[1, "phase", "sft"], [1, "sft/loss/master", 5.5], [1, "step", 1],
                                [2, "grpo/reward", 0.25], [2, "phase", "grpo"], [2, "step", 2]]


def test_the_digest_ignores_timings_and_sees_the_last_bit():
    timed = [{**ROWS[0], "time": 99.0}, {**ROWS[1], "rollout/seconds": 7.0}]
    assert fp.digest(timed) == fp.digest(ROWS)
    nudged = [{**ROWS[0], "sft/loss/master": 5.500000000000001}, ROWS[1]]
    assert fp.digest(nudged) != fp.digest(ROWS)
    assert len(fp.digest(ROWS)) == 64


def test_first_difference_names_the_step_key_and_both_values():
    ours = fp.numbers(ROWS)
    assert fp.first_difference(ours, fp.numbers([dict(r) for r in ROWS])) is None
    other = fp.numbers([ROWS[0], {**ROWS[1], "grpo/reward": 0.5}])
    assert fp.first_difference(ours, other) == ([2, "grpo/reward", 0.25], [2, "grpo/reward", 0.5])
    assert fp.first_difference(ours, fp.numbers(ROWS[:1])) == ([2, "grpo/reward", 0.25], [])


def test_against_recorded_compares_with_each_kept_run_of_the_same_overrides(tmp_path):
    other = fp.numbers([ROWS[0], {**ROWS[1], "grpo/reward": 0.5}])
    (tmp_path / "a.json").write_text(json.dumps(fp.numbers(ROWS)))
    (tmp_path / "b.json").write_text(json.dumps(other))
    base = {"overrides": fp.OVERRIDES, "commit": "c0"}
    records = [{**base, "device": "cpu: A", "values_file": "a.json"},
               {**base, "device": "cpu: B", "values_file": "b.json"},
               {**base, "device": "cpu: C"},  # recorded before the values were kept
               {**base, "device": "cpu: D", "values_file": "missing.json"},
               {**base, "overrides": {"sft.steps": 5}, "device": "cpu: E", "values_file": "a.json"}]
    assert fp.against_recorded(fp.numbers(ROWS), records, str(tmp_path)) == [
        "against cpu: A (c0): the same numbers",
        "against cpu: B (c0): first difference ([step, key, value]): ours "
        "[2, 'grpo/reward', 0.25], theirs [2, 'grpo/reward', 0.5]"]
