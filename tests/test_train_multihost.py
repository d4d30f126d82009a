"""`joyagents train` as one JAX job over two processes (launch/multiprocess_cpu.sh, 2 x 4 CPU
devices): a SIGKILLed process ends the job, and the rerun resumes and logs the metrics of an
uninterrupted run of one process with 8 devices and the same mesh; one process writes."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_distributed import finish_group, start_group
from tests.test_sharding import ROOT
from tests.test_train import TIMING, _rows

pytestmark = pytest.mark.slow

# Every batch splits over data=2 (one half per process) x fsdp=4 (params split within a
# process, as on a pod where fsdp stays inside a host's fast interconnect). select=agents runs
# the jitted GRPO step on the rollouts although a 2-step SFT leaves no reward spread (zero
# advantages: its loss, KL and norms are compared, the parameters do not move); rollouts,
# memory and evaluations all take part.
OVERRIDES = {"mesh": "data=2,fsdp=-1", "sft.steps": 2, "sft.batch_per_agent": 8, "grpo.steps": 2,
             "grpo.queries": 2, "grpo.replay": 1, "grpo.group_size": 2, "grpo.select": "agents",
             "limits.max_tokens_per_node": 16, "eval.examples": 2, "eval.grpo_every": 0,
             "checkpoint.every": 1}
STEPS = 4
# The job must end this soon after a process dies: the launcher's SIGTERM, then its SIGKILL 10 s
# later (a survivor waits in a collective with the dead peer; JAX's own heartbeat timeout would
# end it only after 100 s).
HANG_TIMEOUT_S = 60


def _args(workdir, data_dir):
    return ["train", f"--workdir={workdir}", f"--config.data_dir={data_dir}"] + [
        f"--config.{k}={v}" for k, v in OVERRIDES.items()]


# Both jobs compile at the suite's backend optimization level (tests/conftest.py), nothing else
# of its XLA_FLAGS: the launcher sets the device count.
OPT_LEVEL = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if f.startswith("--xla_backend_optimization_level"))


def _launch(workdir, data_dir) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": OPT_LEVEL}
    return start_group(["bash", "launch/multiprocess_cpu.sh", "-n", "2", "-d", "4",
                        *_args(workdir, data_dir)], env)


def _assert_same_metrics(a, b):
    """Same steps and keys; values equal to float tolerance (collectives may sum differently)."""
    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for x, y in zip(ra, rb):
        assert sorted(x) == sorted(y), (x["step"], set(x) ^ set(y))
        for k in x:
            if isinstance(x[k], str):
                assert x[k] == y[k], (x["step"], k)
            else:
                np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-6,
                                           err_msg=f"step {x['step']}: {k}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("suite"))


def _pid_of_process(index: int, workdir: str) -> int:
    """The pid of the job's process `index` (its JAX_PROCESS_ID), found through /proc."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if workdir in cmdline and f"JAX_PROCESS_ID={index}\0" in environ and "python" in cmdline:
            return int(pid)
    raise AssertionError(f"no process {index} of the job on {workdir}")


@pytest.fixture(scope="module")
def killed_then_rerun(tmp_path_factory, data_dir):
    """A two-process job whose process 1 is SIGKILLed once checkpoint 2 exists, then the same
    command again: what each attempt printed and how it ended."""
    workdir = str(tmp_path_factory.mktemp("two_processes"))
    proc = _launch(workdir, data_dir)
    folder = os.path.join(workdir, "checkpoints")
    start = time.time()
    while not (os.path.isdir(folder) and any(d.isdigit() and int(d) >= 2
                                             for d in os.listdir(folder))):
        assert proc.poll() is None, f"the job ended early:\n{finish_group(proc, 900)[-6000:]}"
        assert time.time() - start < 900, "no checkpoint appeared"
        time.sleep(0.2)
    os.kill(_pid_of_process(1, workdir), signal.SIGKILL)
    killed_out = finish_group(proc, HANG_TIMEOUT_S)
    steps_logged = [r["step"] for r in _rows(workdir)]
    rerun = _launch(workdir, data_dir)
    rerun_out = finish_group(rerun, 900)
    return {"workdir": workdir, "killed_rc": proc.returncode, "killed_out": killed_out,
            "steps_logged": steps_logged, "rerun_rc": rerun.returncode, "rerun_out": rerun_out}


def test_a_killed_process_ends_the_job(killed_then_rerun):
    run = killed_then_rerun
    assert run["killed_rc"] != 0
    assert "process 1 exited with status" in run["killed_out"]
    assert run["steps_logged"] and max(run["steps_logged"]) < STEPS  # it stopped early


def test_the_rerun_resumes_and_logs_what_one_process_with_8_devices_logs(
        killed_then_rerun, data_dir, tmp_path):
    run = killed_then_rerun
    assert run["rerun_rc"] == 0, run["rerun_out"][-6000:]
    assert "Resumed from step" in run["rerun_out"]
    one = str(tmp_path / "one_process")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {OPT_LEVEL}"}
    proc = subprocess.run([sys.executable, "-m", "joyagents_jax.cli", *_args(one, data_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _assert_same_metrics(run["workdir"], one)
    final = lambda w: {k: v for k, v in json.load(open(os.path.join(w, "final_eval.json"))).items()
                       if not any(t in k for t in TIMING)}
    assert final(run["workdir"]) == pytest.approx(final(one), rel=1e-5, abs=1e-6)
    info = json.load(open(os.path.join(run["workdir"], "run_info.json")))
    assert info == {"process_count": 2, "global_device_count": 8, "local_device_count": 4,
                    "mesh": {"agent": 1, "data": 2, "fsdp": 4, "tensor": 1}, "backend": "cpu"}
    assert json.load(open(os.path.join(one, "run_info.json")))["process_count"] == 1


def test_only_process_0_prints_and_writes(killed_then_rerun):
    lines = killed_then_rerun["rerun_out"].split("\n")  # a bar redraws with \r in one line
    assert any(line.startswith("[p0]") and "train:" in line for line in lines)
    assert any(line.startswith("[p0] Finished:") for line in lines)
    assert not [line for line in lines if line.startswith("[p1]")
                and any(w in line for w in ("train:", "Finished", "INFO", "WARNING"))], lines
