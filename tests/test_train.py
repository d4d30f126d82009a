"""The pipeline end to end on a tiny config: CLI, exact resume, preemption, fallback, export."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from joyagents_jax import checkpoint, evaluate, export, metrics, train
from joyagents_jax import config as config_lib

pytestmark = pytest.mark.slow

# A few steps of every phase, tiny batches; memory on so its state is checkpointed too.
OVERRIDES = {"sft.steps": 3, "sft.batch_per_agent": 2, "grpo.steps": 3, "grpo.queries": 2,
             "grpo.group_size": 2, "limits.max_tokens_per_node": 24, "eval.examples": 2,
             "eval.every": 3, "checkpoint.every": 1, "sampler.min_prompt_bucket": 16,
             "sampler.min_batch_bucket": 1, "pad_to_max_len": False}
TIMING = ("seconds", "tokens_per_second", "time/")  # wall-clock metrics differ between runs


def _config(**extra):
    c = config_lib.get_config()
    for key, value in {**OVERRIDES, **extra}.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


def _cli_args(workdir, **extra):
    return [f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in {**OVERRIDES, **extra}.items()]


def _train_process(workdir, data_dir, **extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "joyagents_jax.cli", "train",
                             *_cli_args(workdir, data_dir=data_dir, **extra)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_checkpoint(proc, directory, min_step, timeout=300):
    start = time.time()
    while time.time() - start < timeout:
        steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
        if steps and max(steps) >= min_step:
            return max(steps)
        if proc.poll() is not None:
            raise AssertionError(f"training exited early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no checkpoint appeared in time")


def _rows(workdir):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING) and k != "time"}
            for r in metrics.read_metrics(workdir)]


def _final_params(workdir):
    """Step and every array of the restored state and memory tables (PRNG keys as data)."""
    _, state, memory, step = evaluate.load_run(workdir)
    as_array = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x
    return step, [np.asarray(as_array(x)) for x in jax.tree.leaves((state, memory.tables))]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("suite"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
    """An uninterrupted run of all 6 steps."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    train.train(_config(data_dir=data_dir), workdir)
    return workdir


def test_killed_run_resumes_to_identical_params_memory_and_metrics(reference_run, data_dir, tmp_path):
    workdir = str(tmp_path / "killed")
    proc = _train_process(workdir, data_dir)
    _wait_for_checkpoint(proc, os.path.join(workdir, "checkpoints"), 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    train.train(_config(data_dir=data_dir), workdir)  # resumes from the latest checkpoint
    step, leaves = _final_params(workdir)
    ref_step, ref_leaves = _final_params(reference_run)
    assert step == ref_step == 6
    for a, b in zip(leaves, ref_leaves):
        np.testing.assert_array_equal(a, b)
    assert _rows(workdir) == _rows(reference_run)


def test_sigterm_saves_a_checkpoint_that_resumes(data_dir, tmp_path):
    workdir = str(tmp_path / "preempted")
    proc = _train_process(workdir, data_dir, **{"checkpoint.every": 100})
    ckpts = os.path.join(workdir, "checkpoints")
    _wait_for_checkpoint(proc, ckpts, 3)  # the end-of-SFT checkpoint
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    stopped = max(int(d) for d in os.listdir(ckpts) if d.isdigit())
    assert stopped < 6 and "Preempted at step" in out
    final = train.train(_config(data_dir=data_dir, **{"checkpoint.every": 100}), workdir)
    assert "eval/test/accuracy" in final
    assert max(int(d) for d in os.listdir(ckpts) if d.isdigit()) == 6


def test_corrupted_latest_checkpoint_falls_back(reference_run, tmp_path, caplog):
    import shutil
    workdir = str(tmp_path / "copy")
    shutil.copytree(reference_run, workdir)
    latest = os.path.join(workdir, "checkpoints", "6")
    for root, _, files in os.walk(latest):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
        fresh = evaluate.experiment.Experiment(_config(), workdir)
        tree, meta = ckpt.restore_latest_valid(
            lambda m: train.abstract_tree(fresh, fresh.init_state(), m["phase"]))
    assert meta["step"] == 5 and "6" in caplog.text


def test_cli_train_eval_export_plot(reference_run, tmp_path):
    import torch
    import transformers
    from joyagents_jax.models import qwen2

    files = os.listdir(reference_run)
    assert {"metrics.jsonl", "config.json", "final_eval.json", "plots", "tb"} <= set(files)
    rows = metrics.read_metrics(reference_run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert {r["phase"] for r in rows} == {"sft", "grpo"}
    for r in (r for r in rows if r["phase"] == "grpo"):  # the step's cost split
        assert 0 < r["rollout/seconds"] + r["time/update_seconds"] <= r["time/step_seconds"]
        assert r["time/memory_update_seconds"] > 0
    assert all(p.endswith(".png") for p in os.listdir(os.path.join(reference_run, "plots")))
    assert json.load(open(os.path.join(reference_run, "final_eval.json")))["eval/test/accuracy"] >= 0

    from joyagents_jax import cli
    assert cli.main(["eval", "--workdir", reference_run, "--examples", "2"]) == 0
    results = json.load(open(os.path.join(reference_run, "eval_6.json")))
    assert set(results) == {"test, memory", "test, no memory", "test_novel, memory",
                            "test_novel, no memory"}
    out = str(tmp_path / "export")
    assert cli.main(["export", "--workdir", reference_run, "--out", out]) == 0
    exp, state, _, _ = evaluate.load_run(reference_run)
    tokens = np.array([[1, 60, 70, 80, 90]])
    for agent, (group, index) in exp.slots.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, agent))
        with torch.no_grad():
            ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
        params = jax.tree.map(lambda x: x[index], state.groups[group].params)
        ours = qwen2.forward(state.groups[group].model, params, tokens).logits
        np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)
    assert os.path.isfile(os.path.join(out, "memory.jsonl"))
    assert cli.main(["plot", "--workdir", reference_run]) == 0


@pytest.mark.parametrize("overrides, message", [
    ({"agents": ("master", "qa", "chef")}, "unknown agent"),
    ({"grpo.topk": -1}, "config.grpo.topk must be >= 1"),
    ({"grpo.group_size": 1}, "config.grpo.group_size must be >= 2"),
    ({"grpo.mode": "beam"}, "config.grpo.mode must be"),
    ({"grpo.micro_batch": 12}, "config.grpo.micro_batch must be a power of two"),
    ({"groups.all.checkpoint": "/nonexistent/qwen"}, "not found"),
    ({"groups.all.model": "qwen9"}, "Unknown model preset 'qwen9'"),
    ({"tokenizer": "/nonexistent/tok"}, "tokenizer"),
])
def test_bad_config_fails_at_start_naming_the_field(overrides, message, tmp_path, data_dir):
    with pytest.raises(ValueError, match=message):
        train.train(_config(data_dir=data_dir, **overrides), str(tmp_path / "bad"))


def test_vocab_mismatch_is_named(tmp_path, data_dir):
    from tests.models.conftest import TINY_CONFIGS, build_hf_qwen2

    folder = tmp_path / "small_vocab"
    build_hf_qwen2(folder, **TINY_CONFIGS["tied_kv1"])  # 97 tokens < the byte tokenizer's 264
    with pytest.raises(ValueError, match=r"vocabulary \(97\) is smaller than the tokenizer's"):
        train.train(_config(data_dir=data_dir, **{"groups.all.checkpoint": str(folder)}),
                    str(tmp_path / "bad"))
