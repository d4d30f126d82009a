"""A run's numeric fingerprint, to tell whether two CPUs compute the same numbers.

    python benchmarks/fingerprint.py

Trains the default (seed 0) for 60 SFT steps and 2 GRPO steps with a 20-query evaluation in a
temporary folder, with the numerics `joyagents` pins, and hashes every value `metrics.jsonl`
logged except the wall-clock ones (keys naming a time or seconds). Two hosts that print the same
hash ran the same arithmetic; a different hash names the first step and key where they part when
compared with `--against` (a metrics.jsonl from the other host) or with a recorded host. Merges
its record (device, hash, the step-60 SFT loss) into `benchmarks/results/fingerprint.json`, one
per device and commit, and the hashed values beside it (`results/fingerprint/<hash>.json`), so
the hosts this project meets accumulate and each new one names where it parts from each of them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from joyagents_jax import xla_flags  # noqa: E402

xla_flags.pin_cpu_numerics()

import hardware  # noqa: E402
import learning_study  # noqa: E402
from joyagents_jax import train  # noqa: E402

OVERRIDES = {"sft.steps": 60, "sft.shared_steps": 60, "grpo.steps": 2, "eval.examples": 20}


def is_timing(key: str) -> bool:
    """Keys whose values are wall-clock readings, which differ between any two runs."""
    return "time" in key or "second" in key


def numbers(rows: list[dict]) -> list[list]:
    """[step, key, value] of every logged value but the timings, in logging order."""
    return [[row.get("step"), key, value] for row in rows for key, value in sorted(row.items())
            if not is_timing(key)]


def digest(rows: list[dict]) -> str:
    """sha256 of `numbers(rows)`; JSON writes each float's shortest exact repr."""
    return hashlib.sha256(json.dumps(numbers(rows)).encode()).hexdigest()


def first_difference(ours: list[list], theirs: list[list]) -> tuple[list, list] | None:
    """The first [step, key, value] of two runs' `numbers` that differs, ours and theirs ([]
    past the end of the shorter run); None when they logged the same numbers."""
    for a, b in zip(ours, theirs):
        if a != b:
            return a, b
    if len(ours) == len(theirs):
        return None
    n = min(len(ours), len(theirs))
    return (ours[n:] or [[]])[0], (theirs[n:] or [[]])[0]


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def describe(diff: tuple[list, list] | None) -> str:
    """`first_difference`'s answer in words."""
    return ("the same numbers" if diff is None
            else f"first difference ([step, key, value]): ours {diff[0]}, theirs {diff[1]}")


def against_recorded(nums: list[list], records: list[dict], folder: str) -> list[str]:
    """One line per recorded run of the same overrides whose values were kept: the same numbers
    as ours, or the first value where they part."""
    lines = []
    for r in records:
        path = os.path.join(folder, r.get("values_file", ""))
        if r.get("overrides") == OVERRIDES and r.get("values_file") and os.path.exists(path):
            with open(path) as f:
                theirs = json.load(f)
            lines.append(f"against {r['device']} ({r['commit']}): "
                         f"{describe(first_difference(nums, theirs))}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", help="another host's metrics.jsonl of this run, to compare")
    p.add_argument("--keep", help="folder to keep this run's workdir in (default: deleted)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "fingerprint.json"))
    a = p.parse_args()
    xla_flags.use_compilation_cache()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = a.keep or os.path.join(tmp, "run")
        train.train(learning_study.config_for(0, OVERRIDES), workdir)
        rows = read_rows(os.path.join(workdir, "metrics.jsonl"))
    nums, folder, sha = numbers(rows), os.path.dirname(os.path.abspath(a.out)), digest(rows)
    sft = [r for r in rows if r.get("phase") == "sft" and "sft/loss/master" in r]
    record = {"model": "default", "commit": hardware.git_commit(), "overrides": OVERRIDES,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "sha256": sha,
              "values": len(nums), "sft_loss_master_60": sft[-1]["sft/loss/master"],
              "values_file": os.path.join("fingerprint", sha + ".json")}
    recorded = []
    if os.path.exists(a.out):
        with open(a.out) as f:
            recorded = json.load(f)
    print(f"{hardware.device_name()}: sha256 {record['sha256']} over {record['values']} values; "
          f"SFT loss (master) at step 60: {record['sft_loss_master_60']!r}")
    print("\n".join(against_recorded(nums, recorded, folder)))
    if a.against:
        theirs = numbers(read_rows(a.against))
        print(f"against {a.against}: {describe(first_difference(nums, theirs))}")
    os.makedirs(os.path.join(folder, "fingerprint"), exist_ok=True)
    with open(os.path.join(folder, record["values_file"]), "w") as f:
        json.dump(nums, f, separators=(",", ":"))
    hardware.record_results(a.out, [record], {"commit": None})


if __name__ == "__main__":
    main()
