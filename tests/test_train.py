"""The pipeline end to end on a tiny config: CLI, exact resume, preemption, fallback, export."""

import collections
import json
import math
import os
import select
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

from joyagents_jax import batching, checkpoint, evaluate, export, metrics, selection, train
from joyagents_jax import config as config_lib
from joyagents_jax import workdir as workdir_lib
from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.rl import rollout

pytestmark = pytest.mark.slow

# A few steps of every phase, tiny batches; memory, replay and the chosen iterate on so their
# state is checkpointed too (GRPO steps 2 and 3 scored on 4 train records).
OVERRIDES = {"sft.steps": 3, "sft.batch_per_agent": 2, "grpo.steps": 3, "grpo.queries": 2,
             "grpo.replay": 1, "grpo.select_every": 2, "grpo.select_examples": 4,
             "grpo.group_size": 2, "limits.max_tokens_per_node": 24,
             "eval.examples": 2, "eval.grpo_every": 2, "checkpoint.every": 1,
             "sampler.min_prompt_bucket": 16, "sampler.min_batch_bucket": 1,
             "pad_to_max_len": False}
TIMING = ("seconds", "tokens_per_second", "time/")  # wall-clock metrics differ between runs


def _config(**extra):
    return config_lib.override(config_lib.get_config(), {**OVERRIDES, **extra})


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
    """Step and every array of the restored run state, memory tables included (PRNG keys as
    data)."""
    _, run = evaluate.load_run(workdir)
    as_array = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x
    assert run.memory  # the GRPO phase's tables are part of what is restored
    return int(run.step), [np.asarray(as_array(x)) for x in jax.tree.leaves(run)]


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


def test_a_fresh_process_of_one_seed_logs_the_same_metrics(reference_run, data_dir, tmp_path):
    """A new process with a fixed hash seed (pytest's own is random: set and dict orders of
    strings differ) logs every value of the in-process reference run. The GRPO steps sample
    rollouts, score them and update the memory (the tiny SFT leaves no reward spread, so no
    GRPO update runs here: the update's determinism is the resume test's)."""
    workdir = str(tmp_path / "hash1")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": "1"}
    proc = subprocess.run([sys.executable, "-m", "joyagents_jax.cli", "train",
                           *_cli_args(workdir, data_dir=data_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(workdir) == _rows(reference_run)
    assert sum(r.get("rollout/generated_tokens", 0) for r in _rows(workdir)) > 0
    finals = [{k: v for k, v in json.load(open(os.path.join(w, "final_eval.json"))).items()
               if not any(t in k for t in TIMING)} for w in (workdir, reference_run)]
    assert finals[0] == finals[1] and "eval/test/accuracy" in finals[0]


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


def test_a_closed_terminal_saves_a_checkpoint_and_leaves_the_last_lines_in_the_workdir(
        data_dir, tmp_path, spawn_on_a_terminal):
    """As over a dropped ssh connection: train leads a session whose terminal's master closes."""
    workdir = tmp_path / "hung_up"
    pid, master = spawn_on_a_terminal(
        [sys.executable, "-m", "joyagents_jax.cli", "train",
         *_cli_args(workdir, data_dir=data_dir, **{"checkpoint.every": 100})],
        {**os.environ, "JAX_PLATFORMS": "cpu"})
    seen, deadline = b"", time.time() + 300
    while not workdir_lib.step_dirs(workdir):  # the end-of-SFT checkpoint
        assert time.time() < deadline, "no checkpoint appeared in time"
        if select.select([master], [], [], 0.2)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:
                pytest.fail(f"training exited early:\n{seen.decode(errors='replace')[-3000:]}")
    os.close(master)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert 3 < workdir_lib.step_dirs(workdir)[-1] < 6
    assert "Preempted at step" in (workdir / workdir_lib.HANGUP_LOG).read_text()


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
            lambda m: train.abstract_run(fresh, fresh.init_run(), m))
    assert meta["step"] == 5 and "6" in caplog.text


def test_cli_train_eval_export_plot(reference_run, tmp_path, capsys):
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
    final = json.load(open(os.path.join(reference_run, "final_eval.json")))
    assert final == {k: v for k, v in rows[-1].items()
                     if k.startswith("eval") or k == "select/chosen_step"}
    assert {"eval/test/accuracy", "eval/test_novel/accuracy", "eval_no_memory/test/accuracy",
            "eval_no_memory/test_novel/accuracy"} <= set(final)
    assert [r["step"] for r in rows if "eval/test/accuracy" in r] == [3, 5, 6]
    assert [r["step"] for r in rows if "eval_no_memory/test/accuracy" in r] == [5, 6]

    from joyagents_jax import cli
    assert cli.main(["eval", "--workdir", reference_run, "--examples", "2"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", reference_run, "--step", "99"]) == 2
    assert "no checkpoint step 99 in" in capsys.readouterr().err  # one line, no traceback
    results = json.load(open(os.path.join(reference_run, "eval_6.json")))
    assert set(results) == {"test, memory", "test, no memory", "test_novel, memory",
                            "test_novel, no memory"}
    out = str(tmp_path / "export")
    assert cli.main(["export", "--workdir", reference_run, "--out", out]) == 0
    exp, run = evaluate.load_run(reference_run)
    state = run.train
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


def test_exported_agents_generate_our_greedy_text_in_transformers_alone(reference_run, tmp_path):
    """Tokenizer and weights from the export folder only: the same greedy text as our sampler."""
    import torch
    import transformers
    from joyagents_jax.agents import protocol
    from joyagents_jax.sampling import SamplingConfig

    out = str(tmp_path / "export")
    export.export(reference_run, out)
    exp, run = evaluate.load_run(reference_run)
    state = run.train
    query = "What is the price of the Aero Lamp?"
    for agent in ("master", "qa"):
        group, index = exp.slots[agent]
        assert exp.samplers[group].decode_phases == exp.config.sampler.decode_phases
        prompt = protocol.render_prompt(exp.tokenizer, exp.system.specs[agent], query, [])
        ours = exp.samplers[group].generate(
            state.groups[group].params, [exp.tokenizer.encode(prompt)], agent=index,
            key=jax.random.key(0), scfg=SamplingConfig(16, greedy=True),
            stop_ids=exp.tokenizer.stop_ids)
        ours_text = exp.tokenizer.decode(ours.tokens[0, 0, :int(ours.lengths[0, 0])])

        tok = transformers.AutoTokenizer.from_pretrained(os.path.join(out, agent))
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, agent))
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=16, do_sample=False,
                                 eos_token_id=list(exp.tokenizer.stop_ids),
                                 pad_token_id=tok.pad_token_id)
        hf_text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        assert ids[0].tolist() == exp.tokenizer.encode(prompt)
        assert hf_text.removesuffix("<|endoftext|>").removesuffix("<|im_end|>") == ours_text
        assert ours_text, "an empty generation would compare nothing"


def test_an_export_is_replaced_whole_or_not_at_all(reference_run, tmp_path, monkeypatch):
    def files(folder):
        return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
                if p.is_file()}

    out = tmp_path / "export"
    export.export(reference_run, str(out))
    (out / "math_of_another_run").mkdir()  # what an export of other agents left
    (out / "math_of_another_run" / "config.json").write_text("{}")
    before = files(out)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export.memory_lib, "dump", disk_full)  # after every agent's weights
    with pytest.raises(OSError, match="No space left"):
        export.export(reference_run, str(out))
    assert files(out) == before  # the previous export, untouched
    assert [p.name.split("-")[0] for p in tmp_path.glob("export.partial-*")] == ["export.partial"]
    monkeypatch.undo()
    export.export(reference_run, str(out))
    assert not (out / "math_of_another_run").exists()
    assert files(out).keys() == {k for k in before if "math_of_another_run" not in k}
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("not an export")
    with pytest.raises(ValueError, match="not an export .*new or empty folder"):
        export.export(reference_run, str(tmp_path / "notes"))


def test_a_failed_save_ends_train_with_one_line_and_status_1(tmp_path, monkeypatch, capsys):
    def disk_full(config, workdir):
        raise checkpoint.SaveError("writing a checkpoint to W failed (No space left on device).")

    monkeypatch.setattr(train, "train", disk_full)
    assert train.main([f"--workdir={tmp_path}"]) == 1
    assert capsys.readouterr().err == ("joyagents train: writing a checkpoint to W failed (No "
                                       "space left on device).\n")


def test_a_bad_config_fails_before_the_workdir_is_touched(tmp_path):
    data = tmp_path / "data"
    with pytest.raises(ValueError, match=r"2 config problem\(s\):\n  - config.grpo.kl='k9'"):
        train.train(_config(data_dir=str(data), **{"grpo.kl": "k9", "eval.grpo_every": -1}),
                    str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists() and not data.exists()  # no workdir, no suite built


def test_rerunning_a_finished_run_changes_nothing(reference_run, capsys):
    def snapshot():
        return {os.path.relpath(os.path.join(root, f), reference_run):
                open(os.path.join(root, f), "rb").read()
                for root, _, files in os.walk(reference_run) for f in files
                if not f.startswith("eval_") and f != workdir_lib.LOCK}  # the lock: who holds it
    before = snapshot()
    final = train.train(_config(), reference_run)
    assert snapshot() == before
    assert final == json.load(open(os.path.join(reference_run, "final_eval.json")))
    out = capsys.readouterr().out
    assert "already complete; nothing was changed" in out
    assert "test: " in out and "(policies alone, without the memory: " in out


def test_an_overflowing_update_stops_the_run_and_saves_no_non_finite_value(tmp_path, data_dir):
    workdir = str(tmp_path / "diverged")
    c = _config(data_dir=data_dir, **{"sft.learning_rate": 1e39, "sft.steps": 6,
                                      "max_skipped_steps": 3})
    with pytest.raises(train.TrainingStopped, match=r"steps 1-3 \(sft\) were all skipped"):
        train.train(c, workdir)
    ckpts = os.path.join(workdir, "checkpoints")
    steps = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())
    assert steps == [1, 2]
    for step in steps:
        _, run = evaluate.load_run(workdir, step)
        state = run.train
        for leaf in jax.tree.leaves(state.groups):
            assert np.all(np.isfinite(np.asarray(leaf))), step
        assert int(state.skipped) == step and int(state.step) == 0


def test_every_zero_evaluates_and_saves_at_phase_ends_only(tmp_path, data_dir):
    workdir = str(tmp_path / "ends")
    train.train(_config(data_dir=data_dir, **{"eval.sft_every": 0, "eval.grpo_every": 0, "checkpoint.every": 0}), workdir)
    rows = metrics.read_metrics(workdir)
    assert [r["step"] for r in rows if "eval/test/accuracy" in r] == [3, 6]
    ckpts = os.path.join(workdir, "checkpoints")
    assert sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()) == [3, 6]


def test_a_workdir_without_a_readable_checkpoint_is_refused(reference_run, tmp_path):
    import shutil
    workdir = tmp_path / "corrupt"
    shutil.copytree(reference_run, workdir)
    (workdir / "final_eval.json").unlink()
    for step in (p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()):
        for f in step.rglob("*"):
            if f.is_file():
                f.write_bytes(b"garbage")
    for _ in range(2):  # the second run finds only set-aside steps: refused again, at once
        with pytest.raises(ValueError, match="no readable checkpoint.*--config.restart=true"):
            train.train(_config(), str(workdir))
    assert not any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir())
    assert len(metrics.read_metrics(workdir)) == 6  # the old run's log is still there


def test_vocab_mismatch_is_named(tmp_path, data_dir):
    from tests.models.conftest import TINY_CONFIGS, build_hf_qwen2

    folder = tmp_path / "small_vocab"
    build_hf_qwen2(folder, **TINY_CONFIGS["tied_kv1"])  # 97 tokens < the byte tokenizer's 264
    with pytest.raises(ValueError, match=r"vocabulary \(97\) is smaller than the tokenizer's"):
        train.train(_config(data_dir=data_dir, tokenizer="bytes",
                            **{"groups.all.checkpoint": str(folder)}),
                    str(tmp_path / "bad"))


def test_demonstrations_longer_than_max_len_are_refused_before_any_step(tmp_path, data_dir):
    workdir = tmp_path / "short"
    with pytest.raises(ValueError, match=r"config.max_len=64: the longest SFT demonstration has "
                                         r"\d+ tokens.*raise max_len to at least \d+"):
        train.train(_config(data_dir=data_dir, max_len=64), str(workdir))
    assert not (workdir / "checkpoints").exists() or not os.listdir(workdir / "checkpoints")


def test_demonstrations_with_more_nodes_than_max_nodes_are_refused_by_name(tmp_path, data_dir):
    with pytest.raises(ValueError, match=r"config.limits.max_nodes=2: the longest SFT "
                                         r"demonstration has \d+ LLM nodes.*raise "
                                         r"limits.max_nodes to at least \d+"):
        train.train(_config(data_dir=data_dir, **{"limits.max_nodes": 2}), str(tmp_path / "w"))


def test_lora_run_checkpoints_adapters_only_and_resumes_exactly(data_dir, tmp_path):
    """LoRA from the end of a 2-step shared SFT phase: adapters train in the last SFT step and
    in GRPO over the frozen shared base, which is written once; checkpoints hold adapters only,
    and a run resumed from step 4 ends bit-equal to the uninterrupted one."""
    import shutil
    lora = {"lora.rank": 4, "sft.shared_steps": 2, "sft.warmup_steps": 0}
    full = str(tmp_path / "full")
    train.train(_config(data_dir=data_dir, **lora), full)
    layout = json.load(open(os.path.join(full, "checkpoints", "6", "layout", "metadata")))
    layout = layout["arrays"]
    assert any("'a']" in p for p in layout) and not any(".base" in p for p in layout)
    assert not any("'embed']" in p for p in layout)  # no base weights in any checkpoint
    exp, run = evaluate.load_run(full)
    group = run.train.groups["all"]
    assert group.lora.rank == 4 and group.base["embed"].ndim == 2  # the base has no agent axis
    _check_lora_export(exp, group, str(tmp_path / "export"), full)
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    for name in ("5", "6", "final_eval.json"):
        path = os.path.join(resumed, "checkpoints", name) if name.isdigit() else \
            os.path.join(resumed, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    train.train(_config(data_dir=data_dir, **lora), resumed)
    step, leaves = _final_params(resumed)
    ref_step, ref_leaves = _final_params(full)
    assert step == ref_step == 6 and len(leaves) == len(ref_leaves)
    for a, b in zip(leaves, ref_leaves):
        np.testing.assert_array_equal(a, b)
    assert _rows(resumed) == _rows(full)


def _check_lora_export(exp, group, out, workdir):
    """Each agent's merged folder in transformers, and its PEFT adapter put on the exported
    base by peft, give our unmerged logits."""
    import peft
    import torch
    import transformers
    from joyagents_jax.models import lora, qwen2

    assert export.export(workdir, out)
    base = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "lora", "base_all"))
    tokens = np.array([[1, 60, 70, 80, 90, 100]])
    with torch.no_grad():
        base_logits = base(input_ids=torch.tensor(tokens)).logits.numpy()
    for agent, (_, index) in exp.slots.items():
        ours = np.asarray(qwen2.forward(group.model, lora.pick(group.policies, index),
                                        tokens).logits)
        assert np.abs(ours - base_logits).max() > 1e-3  # the adapters moved this agent
        merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, agent))
        with_adapter = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(out, "lora", "base_all")), os.path.join(out, "lora", agent))
        for model in (merged, with_adapter):
            with torch.no_grad():
                ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
            np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_dynamic_sampling_refills_with_fresh_queries_and_keeps_the_first_rollout(data_dir, tmp_path):
    """grpo.min_groups above what a rollout can give: every refill runs, on new seeded queries,
    and the merged rollout starts with exactly the rollout that dynamic sampling off makes."""
    def rollout_of(**extra):
        exp = evaluate.experiment.Experiment(_config(data_dir=data_dir, **extra),
                                             str(tmp_path / str(len(extra))))
        return exp, exp._rollout(exp.start_grpo(exp.init_run()), 0, exp.train_tasks(0))

    _, (plain, none) = rollout_of()
    exp, (merged, refills) = rollout_of(**{"grpo.min_groups": 10**6, "grpo.max_refills": 2})
    assert (none, refills) == (0, 2)
    queries = [t.query for r in (1, 2) for t in exp.refill_tasks(0, r)]
    assert len(queries) == 2 * exp.config.grpo.queries
    assert [t.query for t in exp.refill_tasks(0, 1)] == [t.query for t in exp.refill_tasks(0, 1)]
    assert [tr.episode.query for tr in merged.episodes[len(plain.episodes):]] == queries
    n = len(plain.samples)
    for a, b in zip(plain.samples, merged.samples[:n]):
        assert (a.agent, a.group, a.prompt_ids, a.reward) == (b.agent, b.group, b.prompt_ids, b.reward)
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
    assert {s.group for s in plain.samples}.isdisjoint(s.group for s in merged.samples[n:])
    assert merged.counters.generated_tokens > plain.counters.generated_tokens


def test_dynamic_sampling_under_agent_selection_counts_the_groups_with_a_reward_spread(
        data_dir, tmp_path):
    """grpo.select=agents trains one member of every flat node group too, but refills while
    fewer than min_groups groups have a reward spread, as under select=groups."""
    def rollout_of(min_groups):
        exp = evaluate.experiment.Experiment(
            _config(data_dir=data_dir, **{"grpo.select": "agents", "grpo.min_groups": min_groups,
                                          "grpo.max_refills": 1}), str(tmp_path / str(min_groups)))
        return exp._rollout(exp.start_grpo(exp.init_run()), 0, exp.train_tasks(0))

    plain, _ = rollout_of(0)
    groups = {s.group for s in plain.samples}
    assert len({s.group for s in batching.informative(plain.samples)}) < len(groups)
    assert rollout_of(len(groups))[1] == 1


def test_replay_reasks_the_queries_with_a_reward_spread_and_checkpoints_them(data_dir, tmp_path):
    """grpo.replay=R: the next step starts with the step's queries that had a node group with a
    reward spread (the first R in rollout order; a refill's queries are not among them), then
    fresh ones up to grpo.queries; the run state carries them through a checkpoint."""
    exp = evaluate.experiment.Experiment(
        _config(data_dir=data_dir, **{"grpo.queries": 3, "grpo.replay": 2}), str(tmp_path / "r"))
    run = exp.start_grpo(exp.init_run())
    run = run.replace(step=run.step + exp.config.sft.steps)  # GRPO's first step
    chex.assert_trees_all_equal(run.replay, np.array([-1, -1], np.int32))
    records = exp.step_records(exp.replayed(run), 0)
    assert records == exp.train_records(0) and len(set(records)) == 3

    def sample(query, group, reward):
        return rollout.Sample("qa", [1], np.zeros(1, np.int32), np.zeros(1, np.float32), reward,
                              reward, group, query, 0)

    agree = [sample(0, 0, 1.0), sample(0, 0, 1.0)]
    spread = [sample(2, 2, 0.0), sample(2, 2, 0.5), sample(1, 1, 1.0), sample(1, 1, 0.0)]
    refill = [sample(3, 3, 0.0), sample(3, 3, 1.0)]
    replay = exp.next_replay(records, agree + spread + refill)
    chex.assert_trees_all_equal(replay, np.array([records[1], records[2]], np.int32))
    chex.assert_trees_all_equal(exp.next_replay(records, agree + spread[:2]),
                                np.array([records[2], -1], np.int32))
    run = run.replace(replay=replay)
    assert exp.step_records(exp.replayed(run), 1) == [records[1], records[2],
                                                      exp.train_records(1)[0]]

    with checkpoint.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(3, run.without_bases(), run.metadata(), force=True)
    with checkpoint.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        restored = train.restore(exp, ckpt)
    chex.assert_trees_all_equal(restored.replay, replay)

    after, m = exp.grpo_iteration(run)  # the loop reads and writes it
    assert m["rollout/replayed"] == 2
    assert after.replay.shape == (2,) and int(after.step) == int(run.step) + 1


def _scripted_selection(monkeypatch, scores: dict[int, float]) -> None:
    """The selection slice's accuracy per run step from `scores`; other splits evaluate."""
    real = evaluate.experiment.Experiment.evaluate

    def scripted(self, run, split, examples=None, use_memory=True):
        if split != "select":
            return real(self, run, split, examples, use_memory)
        assert not use_memory and len(self.sources["select"]) == 4  # grpo.select_examples
        return {"eval/select/accuracy": scores[int(run.step)]}

    monkeypatch.setattr(evaluate.experiment.Experiment, "evaluate", scripted)


def _without_step_6(workdir):
    """The run as a stop after step 5's checkpoint leaves it."""
    import shutil
    shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
    os.remove(os.path.join(workdir, "final_eval.json"))


def test_selection_reports_and_exports_the_best_scored_iterate_and_resumes_it(
        data_dir, tmp_path, monkeypatch):
    """grpo.select_every=2 over 3 GRPO steps scores steps 2 and 3 (run steps 5, 6): the better
    one's policies are the run's result (final evaluation, `joyagents eval`, export) beside the
    last step's memory, and a run resumed after step 5 chooses the same."""
    _scripted_selection(monkeypatch, {5: 0.5, 6: 0.25})
    workdir = str(tmp_path / "select")
    config = _config(data_dir=data_dir)
    final = train.train(config, workdir)
    assert final["select/chosen_step"] == 2
    assert [(r["step"], r["select/accuracy"], r["select/chosen_step"])
            for r in _rows(workdir) if "select/accuracy" in r] == [(5, 0.5, 2), (6, 0.25, 2)]
    exp, run = evaluate.load_run(workdir)
    _, at_5 = evaluate.load_run(workdir, 5)
    assert (int(run.step), int(run.selected.step)) == (6, 5)
    chosen = exp.chosen(run)
    chex.assert_trees_all_equal({g: grp.params for g, grp in chosen.train.groups.items()},
                                {g: grp.params for g, grp in at_5.train.groups.items()})
    assert chosen.memory is run.memory and exp.chosen_step(run) == 5
    assert exp.chosen(at_5) is at_5 and exp.chosen_step(at_5) == 5  # not the end: the iterate
    again = {k: v for k, v in train.final_evaluation(exp, run).items()
             if not any(s in k for s in TIMING)}
    assert again == {k: v for k, v in final.items() if not any(s in k for s in TIMING)}

    out = str(tmp_path / "export")
    assert export.main(["--workdir", workdir, "--out", out]) == 0
    assert json.load(open(os.path.join(out, "export.json")))["policies_step"] == 5
    assert evaluate.main(["--workdir", workdir, "--examples", "2"]) == 0
    assert "The policies of step 5" in open(os.path.join(workdir, "eval_6.md")).read()

    step, leaves = _final_params(workdir)
    _without_step_6(workdir)
    resumed = train.train(config, workdir)
    assert {k: v for k, v in resumed.items() if not any(s in k for s in TIMING)} == again
    resumed_step, resumed_leaves = _final_params(workdir)
    assert resumed_step == step == 6
    for a, b in zip(resumed_leaves, leaves, strict=True):
        np.testing.assert_array_equal(a, b)


def test_selection_turned_on_at_a_resume_starts_with_nothing_chosen(data_dir, tmp_path,
                                                                     monkeypatch):
    """A checkpoint saved without selection restores under a config that asks for it: only the
    steps run after the resume are scored."""
    _scripted_selection(monkeypatch, {6: 0.75})
    workdir = str(tmp_path / "on_at_resume")
    assert "select/chosen_step" not in train.train(
        _config(data_dir=data_dir, **{"grpo.select_every": 0}), workdir)
    _without_step_6(workdir)
    assert train.train(_config(data_dir=data_dir), workdir)["select/chosen_step"] == 3
    _, run = evaluate.load_run(workdir)
    assert int(run.selected.step) == 6


def test_selection_turned_off_at_a_resume_reports_the_last_iterate(reference_run, data_dir,
                                                                    tmp_path):
    import shutil
    workdir = str(tmp_path / "off_at_resume")
    shutil.copytree(reference_run, workdir)
    _without_step_6(workdir)
    final = train.train(_config(data_dir=data_dir, **{"grpo.select_every": 0}), workdir)
    assert "select/chosen_step" not in final and "eval_no_memory/test/accuracy" in final
    _, run = evaluate.load_run(workdir)
    assert not run.selects and int(run.step) == 6


def test_select_split_draws_the_selection_slice_from_the_validation_records(data_dir, tmp_path):
    """grpo.select_split=validation: the iterate is scored on held-out validation records (all
    of them when select_examples exceeds the split), never on records GRPO trains on."""
    make = lambda name, **extra: evaluate.experiment.Experiment(
        _config(data_dir=data_dir, **extra), str(tmp_path / name))
    held = make("held", **{"grpo.select_split": "validation", "grpo.select_examples": 10_000})
    queries = lambda exp, split: [suite.decode(r).query for r in exp.sources[split]]
    assert queries(held, "select") == queries(held, "validation")
    train = make("train")
    rows = selection.slice_rows(len(train.sources["train"]), 4)
    assert queries(train, "select") == [suite.decode(train.sources["train"][i]).query
                                        for i in rows]


def test_question_order_visits_every_distinct_train_question_once_per_epoch(data_dir, tmp_path):
    """grpo.query_order=questions: one epoch of GRPO queries is each distinct train question
    once (traffic order: every train record, popular questions as often as recorded)."""
    traffic = evaluate.experiment.Experiment(_config(data_dir=data_dir), str(tmp_path / "t"))
    exp = evaluate.experiment.Experiment(
        _config(data_dir=data_dir, **{"grpo.query_order": "questions"}), str(tmp_path / "q"))
    source = exp.sources["train"]
    assert traffic.grpo_pool == list(range(len(source)))
    distinct = {suite.decode(source[i]).query for i in range(len(source))}
    n, q = len(exp.grpo_pool), exp.config.grpo.queries
    assert n == len(distinct) < len(source)
    epoch = [t.query for k in range(-(-n // q)) for t in exp.train_tasks(k)][:n]
    assert sorted(epoch) == sorted(distinct)
    assert all(t.query in epoch for t in exp.refill_tasks(0, 1))


def test_query_power_keeps_the_first_ceil_n_to_the_power_records_of_each_question(data_dir,
                                                                                  tmp_path):
    """grpo.query_power = p: GRPO's pool keeps the first ceil(n ** p) of a question's n train
    records (p = 1: the traffic; p = 0: one record per question, the question order's pool)."""
    make = lambda name, **extra: evaluate.experiment.Experiment(
        _config(data_dir=data_dir, **extra), str(tmp_path / name))
    half = make("half", **{"grpo.query_power": 0.5})
    source = half.sources["train"]
    records = collections.defaultdict(list)
    for i in range(len(source)):
        records[suite.decode(source[i]).question_id].append(i)
    assert max(map(len, records.values())) > 4  # some question is popular enough to be cut
    want = sorted(i for rows in records.values() for i in rows[:math.ceil(len(rows) ** 0.5)])
    assert half.grpo_pool == want and len(records) < len(want) < len(source)
    assert make("zero", **{"grpo.query_power": 0.0}).grpo_pool == make(
        "q", **{"grpo.query_order": "questions"}).grpo_pool == [rows[0] for rows in sorted(
            records.values())]
    assert all(source_index in want for source_index in half.train_records(0))


def test_domain_repeats_ask_a_domains_records_n_times_as_often(data_dir, tmp_path):
    """grpo.domain_repeats="cooperation=3": each cooperation train record stands three times in
    GRPO's pool, the other domains' once; with query_power the repeats apply to the kept
    records."""
    make = lambda name, **extra: evaluate.experiment.Experiment(
        _config(data_dir=data_dir, **extra), str(tmp_path / name))
    exp = make("r", **{"grpo.domain_repeats": "cooperation=3"})
    source = exp.sources["train"]
    domain = [suite.decode(source[i]).domain for i in range(len(source))]
    counts = collections.Counter(exp.grpo_pool)
    assert sorted(counts) == list(range(len(source)))
    assert {domain[i]: n for i, n in counts.items()} == {
        d: 3 if d == "cooperation" else 1 for d in set(domain)}
    assert len(set(domain)) > 1 and "cooperation" in domain
    half = make("h", **{"grpo.query_power": 0.5}).grpo_pool
    both = make("b", **{"grpo.query_power": 0.5, "grpo.domain_repeats": "cooperation=3"})
    assert collections.Counter(both.grpo_pool) == {
        i: 3 if domain[i] == "cooperation" else 1 for i in half}
    assert all(i in counts for i in exp.train_records(0))


def test_grpo_seed_draws_other_queries_after_the_same_sft_phase(data_dir, tmp_path):
    """grpo.seed = -1 is config.seed; another value changes GRPO's draws (queries, sampling
    key) and nothing of the SFT phase (initial agents, demonstrations, SFT batches)."""
    make = lambda name, **extra: evaluate.experiment.Experiment(
        _config(data_dir=data_dir, seed=3, **extra), str(tmp_path / name))
    default, same, other = make("d"), make("s", **{"grpo.seed": 3}), make("o", **{"grpo.seed": 4})
    assert (default.grpo_seed, same.grpo_seed, other.grpo_seed) == (3, 3, 4)
    records = lambda exp: [exp.train_records(k) for k in range(3)]
    assert records(default) == records(same) != records(other)
    assert default.demos == other.demos
    chex.assert_trees_all_equal(default.init_run().train, other.init_run().train)


def test_demo_seed_fixes_the_demonstrations_across_run_seeds(data_dir, tmp_path):
    """sft.demo_seed = -1 draws the demonstrator's detours from config.seed; a fixed value
    gives every run seed the same demonstrations (its SFT dataset), while the seed still sets
    the initial agents."""
    make = lambda name, seed, **extra: evaluate.experiment.Experiment(
        _config(data_dir=data_dir, seed=seed, **extra), str(tmp_path / name))
    default, same = make("d", 3), make("s", 3, **{"sft.demo_seed": 3})
    fixed3, fixed4 = make("f3", 3, **{"sft.demo_seed": 0}), make("f4", 4, **{"sft.demo_seed": 0})
    assert (default.demo_seed, same.demo_seed, fixed4.demo_seed) == (3, 3, 0)
    assert default.demos == same.demos != fixed3.demos == fixed4.demos
    chex.assert_trees_all_equal(fixed3.init_run().train, default.init_run().train)
    with pytest.raises(AssertionError):
        chex.assert_trees_all_equal(fixed3.init_run().train, fixed4.init_run().train)


def test_init_seed_fixes_the_initial_agents_across_run_seeds(data_dir, tmp_path):
    """init_seed = -1 draws the agents' initial weights from config.seed; a fixed value gives
    every run seed the same weights (as a pretrained checkpoint would), while the seed still
    sets the SFT batches."""
    make = lambda name, seed, **extra: evaluate.experiment.Experiment(
        _config(data_dir=data_dir, seed=seed, **extra), str(tmp_path / name))
    default, same = make("d", 3), make("s", 3, init_seed=3)
    fixed3, fixed4 = make("f3", 3, init_seed=0), make("f4", 4, init_seed=0)
    assert (default.init_seed, same.init_seed, fixed4.init_seed) == (3, 3, 0)
    chex.assert_trees_all_equal(default.init_run().train, same.init_run().train)
    chex.assert_trees_all_equal(fixed3.init_run().train, fixed4.init_run().train)
    with pytest.raises(AssertionError):
        chex.assert_trees_all_equal(default.init_run().train, fixed3.init_run().train)
    with pytest.raises(AssertionError):
        chex.assert_trees_all_equal(fixed3.sft_iteration(fixed3.init_run())[0].train,
                                    fixed4.sft_iteration(fixed4.init_run())[0].train)


def test_sft_order_draws_with_replacement_or_reads_each_demonstration_once_per_epoch(
        data_dir, tmp_path):
    """sft.order="random" (the default) draws each agent's step rows with replacement from
    (seed, step); "epochs" reads a seeded permutation per epoch, so the first len(pool)
    positions hold every demonstration once, and so do the next, in another order."""
    make = lambda name, seed, order: evaluate.experiment.Experiment(
        _config(data_dir=data_dir, seed=seed, **{"sft.order": order}), str(tmp_path / name))
    drawn, epochs, other = make("r", 3, "random"), make("e", 3, "epochs"), make("o", 4, "epochs")
    b = drawn.config.sft.batch_per_agent
    rng = np.random.default_rng([3, 5])
    assert drawn.sft_rows(5) == {a: rng.integers(0, len(drawn.demos[a]), b).tolist()
                                 for a in drawn.config.agents}
    n = {a: len(pool) for a, pool in epochs.demos.items()}
    steps = -(-2 * max(n.values()) // b)
    rows = {a: sum((epochs.sft_rows(k)[a] for k in range(steps)), []) for a in n}
    for agent, read in rows.items():
        first, second = read[:n[agent]], read[n[agent]:2 * n[agent]]
        assert sorted(first) == sorted(second) == list(range(n[agent]))
        assert first != second
        chex.assert_shape(np.asarray(epochs.sft_rows(steps)[agent]), (b,))
    assert epochs.sft_rows(7) == make("e2", 3, "epochs").sft_rows(7) != other.sft_rows(7)


def test_train_tasks_carry_their_gold_outputs(data_dir, tmp_path):
    """GRPO's tasks hold the gold trajectory's node outputs (grpo.gold_branches reads them):
    replayed, they answer their own query with the full R_A + R_F."""
    from joyagents_jax.agents import system
    exp = evaluate.experiment.Experiment(_config(data_dir=data_dir), str(tmp_path / "g"))
    tasks = exp.train_tasks(0) + exp.refill_tasks(0, 1)
    for task in tasks:
        assert len(task.gold) == task.min_llm_calls
        episode = system.demonstration(exp.system, task.query, task.gold)
        parts = episode.reward(task.answer, task.answer_kind, task.min_llm_calls,
                               exp.parts.rollout.rewards)
        assert float(parts.memory_reward) == pytest.approx(1.0 + exp.config.grpo.w_format)


@pytest.mark.parametrize("select", ["groups", "agents"])
def test_trainable_counts_informative_groups_that_hold_a_memory_or_gold_output(data_dir,
                                                                              tmp_path, select):
    """grpo/memory_member_groups and grpo/gold_member_groups: node groups with a reward spread
    whose members include the memory's stored output (grpo.memory_branches) or the gold one
    (grpo.gold_branches); a group that agrees trains nothing (select=agents: its first member
    still counts in the agent's mean group variance)."""
    exp = evaluate.experiment.Experiment(_config(data_dir=data_dir, **{"grpo.select": select}),
                                         str(tmp_path / "m"))

    def sample(group, reward, source=""):
        return rollout.Sample("math", [1, 2], np.array([3], np.int32), np.zeros(1, np.float32),
                              reward, reward, group, 0, 0, from_memory=source == "memory",
                              from_gold=source == "gold")
    samples = [sample(0, 1.0, "memory"), sample(0, 0.0), sample(1, 1.0, "memory"),
               sample(1, 1.0), sample(2, 1.0), sample(2, 0.0), sample(3, 0.0),
               sample(3, 1.0, "gold"), sample(4, 1.0), sample(4, 1.0, "gold")]
    metrics = {}
    trained = exp._trainable(samples, metrics)
    flat = [1, 4] if select == "agents" else []
    assert sorted(s.group for s in trained) == sorted([0, 0, 2, 2, 3, 3] + flat)
    assert metrics["grpo/memory_member_groups"] == 1 and metrics["grpo/gold_member_groups"] == 1


def test_extra_worlds_add_demonstrations_replayed_on_their_own_world(data_dir, tmp_path):
    """sft.extra_worlds=1: the suite's demonstrations unchanged, then one other world's train
    traffic, whose tool observations come from that world (as its gold ones), not the suite's."""
    from joyagents_jax.agents import system
    plain = evaluate.experiment.Experiment(_config(data_dir=data_dir), str(tmp_path / "p"))
    exp = evaluate.experiment.Experiment(_config(data_dir=data_dir, **{"sft.extra_worlds": 1}),
                                         str(tmp_path / "x"))

    def texts(e, pool):  # each run's suite BPE is trained on its own demonstrations: compare text
        return [(e.tokenizer.decode(c), e.tokenizer.decode(o)) for c, o in pool]
    for agent, pool in plain.demos.items():
        assert texts(exp, exp.demos[agent][:len(pool)]) == texts(plain, pool)
        assert len(exp.demos[agent]) > len(pool)
    extra = [(world, ex) for world, prefix, ex in exp._demo_examples() if prefix == "1/"]
    assert len(extra) == len(exp.sources["train"])

    def observed(world, ex) -> bool:
        episode = system.demonstration(world, ex.query, [n.output for n in ex.gold])
        seen = " ".join(text for node in episode.nodes for turn in node.turns for text in turn)
        return all(n.observation in seen for n in ex.gold if n.observation)

    tools = [(world, ex) for world, ex in extra[:200] if any(n.observation for n in ex.gold)]
    assert tools and all(observed(world, ex) for world, ex in tools)
    assert not all(observed(exp.system, ex) for _, ex in tools)


def test_the_state_is_committed_to_its_device_before_the_first_step(data_dir, tmp_path):
    """Without a mesh the fresh SFT state and the state GRPO starts from are committed, as the
    jitted steps' outputs are: the first step then compiles once for both (an uncommitted
    argument is part of jit's cache key, so step 1 would compile again at step 2)."""
    exp = evaluate.experiment.Experiment(_config(data_dir=data_dir), str(tmp_path))
    assert exp.mesh is None
    run = exp.init_run()
    assert all(x.committed for x in jax.tree.leaves(run.train))
    run = exp.start_grpo(run)
    assert all(x.committed for x in jax.tree.leaves(run.train))


def test_self_imitation_trains_only_agents_with_best_memory_entries(data_dir, tmp_path):
    """grpo.self_imitation=2: one supervised step on up to 2 best memory entries per agent
    (here only qa has any, 3 of them): qa's policy moves, every other agent's stays; without an
    eligible entry there is no step. A GRPO iteration runs it after the memory update."""
    exp = evaluate.experiment.Experiment(
        _config(data_dir=data_dir, **{"grpo.self_imitation": 2}), str(tmp_path))
    run = exp.start_grpo(exp.init_run())
    group, qa = exp.slots["qa"]
    tables = jax.tree.map(np.array, run.memory)
    t = tables[group]
    for slot, (context, output) in enumerate(exp.demos["qa"][:3]):
        t.prompt[qa, slot, :len(context)], t.prompt_length[qa, slot] = context, len(context)
        t.response[qa, slot, :len(output)], t.length[qa, slot] = output, len(output)
        t.reward[qa, slot], t.valid[qa, slot] = exp.parts.memory.best_reward, True
    before = jax.device_get(run.train.groups[group].params)
    metrics = {}
    train = exp._self_imitation(run.train, tables, 7, metrics)
    after = jax.device_get(train.groups[group].params)
    assert metrics["self_imitation/rows"] == 2 and metrics["self_imitation/skipped"] == 0
    assert metrics["self_imitation/tokens/qa"] > 0 and metrics["self_imitation/tokens/math"] == 0
    for i, agent in enumerate(exp.config.groups[group].agents):
        moved = any(not np.array_equal(a[i], b[i])
                    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
        assert moved == (agent == "qa"), agent
    metrics = {}
    assert exp._self_imitation(train, run.memory, 7, metrics) is train
    assert metrics == {"self_imitation/rows": 0}
    first_grpo = run.replace(train=train, step=run.step + exp.config.sft.steps)
    _, metrics = exp.grpo_iteration(first_grpo)
    assert "self_imitation/rows" in metrics


def test_sorted_passes_run_the_shared_sft_phase(data_dir, tmp_path):
    """sft.sorted_passes=true: the shared SFT steps run over length-sorted passes and log the
    padded step's metrics up to rounding; after the shared phase (1 step here) the per-agent
    step runs as before, bit for bit where the states agree."""
    runs = {}
    for flag in (False, True):
        exp = evaluate.experiment.Experiment(
            _config(data_dir=data_dir, **{"sft.sorted_passes": flag, "sft.shared_steps": 2}),
            str(tmp_path / str(flag)))
        run, rows = exp.init_run(), []
        for _ in range(3):
            run, metrics = exp.sft_iteration(run)
            rows.append(metrics)
        runs[flag] = run, rows
    (plain, plain_rows), (by_length, sorted_rows) = runs[False], runs[True]
    for p, s in zip(plain_rows, sorted_rows):
        assert p.keys() == s.keys()
        np.testing.assert_allclose([s[k] for k in p], [p[k] for k in p], rtol=2e-4, atol=1e-5)
    chex.assert_trees_all_close(by_length.train.groups, plain.train.groups, rtol=1e-4, atol=1e-4)


def test_a_suite_bpe_run_trains_its_own_tokenizer_once_and_exports_it(data_dir, tmp_path):
    """config.tokenizer=suite_bpe (the default): <workdir>/tokenizer is trained on the
    demonstrations at the first start, read back (not retrained) on resume, and exported for
    transformers; the demonstrations take fewer ids than bytes; the byte-level "tiny" model has
    no room for it."""
    import transformers

    with pytest.raises(ValueError, match="use model 'tiny-bpe'"):
        train.train(_config(data_dir=data_dir, **{"groups.all.model": "tiny"}),
                    str(tmp_path / "bad"))
    workdir = tmp_path / "bpe"
    train.train(_config(data_dir=data_dir), str(workdir))
    file = workdir / "tokenizer" / "suite_bpe.json"
    built = file.stat().st_mtime_ns
    exp, _ = evaluate.load_run(str(workdir))
    assert file.stat().st_mtime_ns == built and exp.tokenizer.path == file
    byte_exp = evaluate.experiment.Experiment(
        _config(data_dir=data_dir, tokenizer="bytes", max_len=512, **{"groups.all.model": "tiny"}),
        str(tmp_path / "b"))
    bpe_ids = sum(len(c) + len(o) for pool in exp.demos.values() for c, o in pool)
    byte_ids = sum(len(c) + len(o) for pool in byte_exp.demos.values() for c, o in pool)
    assert bpe_ids < byte_ids / 2
    out = tmp_path / "export"
    export.export(str(workdir), str(out))
    hf = transformers.AutoTokenizer.from_pretrained(out / "master")
    prompt = exp.tokenizer.decode(exp.demos["efc"][0][0])
    assert hf.encode(prompt) == exp.tokenizer.encode(prompt) == exp.demos["efc"][0][0]


def test_grpo_rows_are_padded_to_pad_rows_to(data_dir, tmp_path, monkeypatch):
    """Every agent's GRPO rows are padded to config.pad_rows_to whatever the sample count."""
    from joyagents_jax import batching

    batches, real = [], batching.grpo_batch
    monkeypatch.setattr(batching, "grpo_batch", lambda *a: batches.append(real(*a)) or batches[-1])
    exp = evaluate.experiment.Experiment(_config(data_dir=data_dir, pad_rows_to=8),
                                         str(tmp_path / "w"))
    run = exp.start_grpo(exp.init_run())
    rollout_result, _ = exp._rollout(run, 0, exp.train_tasks(0))
    train_state = run.train
    for n in (1, 3):
        train_state = exp._update(train_state, rollout_result.samples[:n], {})
        assert [r.tokens.shape[:2] for r in batches[-1].rollouts.values()] == [(5, 8)]
