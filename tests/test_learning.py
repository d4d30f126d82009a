"""GRPO on the real agent system learns: repeated steps on a fixed set of training queries raise
the reward the policies earn on them (fixed seed; no wall-clock threshold)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from joyagents_jax import experiment
from joyagents_jax import config as config_lib
from joyagents_jax.rl import rollout
from tests.test_sharding import ROOT

pytestmark = pytest.mark.slow

# Byte-level agents (`config.byte_default()`, the default when these numbers were measured).
# A short shared SFT on gold demonstrations at the former max_len (the policies emit the protocol
# but rarely a right answer), then full-temperature GRPO on 8 fixed queries, every agent's node
# groups formed and kept, no memory.
# The measure is what GRPO maximizes: the mean reward of SAMPLES per query at the rollout
# temperature (128 episodes). The greedy reward is too coarse to carry the assertion: without a
# right answer it tops out at the format reward 0.1 per query, and SFT alone reaches 0.025-0.075
# (seeds 0-2). Measured with this file's settings, sampled reward after SFT -> after 12 GRPO steps:
# seed 0 0.014 -> 0.055, seed 1 0.019 -> 0.060, seed 2 0.006 -> 0.053 (greedy 0.040 -> 0.100,
# 0.075 -> 0.100, 0.025 -> 0.206). Batches keep the default's fixed shapes (pad_to_max_len,
# sampler buckets of 256 tokens and 4 rows): fewer compiles, 260-285 s alone against 314 s with
# shapes fitted to each batch.
SFT_STEPS, GRPO_STEPS, SAMPLES = 150, 12, 16
OVERRIDES = {"suite": "tiny", "sft.steps": SFT_STEPS, "sft.shared_steps": SFT_STEPS,
             "sft.batch_per_agent": 4, "sft.warmup_steps": 10, "grpo.steps": GRPO_STEPS,
             "grpo.queries": 8, "grpo.group_size": 4, "grpo.topk": 0, "grpo.learning_rate": 1e-3,
             "grpo.temperature": 1.0, "grpo.branch_agents": "", "memory.enabled": False,
             "grpo.replay": 0, "limits.max_tokens_per_node": 48, "sft.demo_redundant_call": 0.0,
             "max_len": 384}


def _config(data_dir):
    return config_lib.override(config_lib.byte_default(), {**OVERRIDES, "data_dir": data_dir})


def _mean_reward(exp, run, tasks, greedy: bool) -> float:
    """The mean episode reward R on `tasks` (each SAMPLES times unless greedy), no memory."""
    engine = rollout.Rollout(exp.system, exp.tokenizer,
                             exp.policy(run.train, jax.random.key(2), greedy=greedy),
                             exp.parts.rollout, None)
    tasks = list(tasks) * (1 if greedy else SAMPLES)
    return float(np.mean([r.total for r in engine.episodes(tasks).rewards]))


def _rewards(exp, run, tasks) -> tuple[float, float]:
    """(sampled, greedy) mean rewards."""
    return _mean_reward(exp, run, tasks, False), _mean_reward(exp, run, tasks, True)


def measure(folder: str) -> None:
    """SFT, then GRPO_STEPS steps on one fixed batch of train queries; writes the sampled and
    greedy rewards before and after, and each step's trained samples, to folder/result.json."""
    exp = experiment.Experiment(_config(os.path.join(folder, "data")),
                                os.path.join(folder, "run"))
    run = exp.init_run()
    for _ in range(SFT_STEPS):
        run, _ = exp.sft_iteration(run)
    records = exp.train_records(0)
    fixed = [exp.task(i) for i in records]
    before = _rewards(exp, run, fixed)

    run = exp.start_grpo(run)
    exp.train_records = lambda k: records  # every GRPO step sees the same queries
    trained = []
    for _ in range(GRPO_STEPS):
        run, m = exp.grpo_iteration(run)
        trained.append(int(m["grpo/trained_samples"]))
    after = _rewards(exp, run, fixed)
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump({"before": before, "after": after, "trained": trained}, f)


def test_grpo_raises_the_reward_of_fixed_training_queries(tmp_path):
    # A fresh process at XLA's default backend optimization level, the one the figures above
    # were measured at and the README runs use (the suite's conftest lowers it for compiles).
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_backend_optimization_level")]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    code = f"from tests.test_learning import measure; measure({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.load(open(tmp_path / "result.json"))
    before, after = result["before"], result["after"]

    assert all(n > 0 for n in result["trained"])  # every step had node groups with a spread
    assert after[0] > before[0] + 0.02, (before, after)  # sampled: at least 2x on seeds 0-2
    assert after[1] >= before[1], (before, after)  # greedy does not fall
