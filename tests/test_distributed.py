"""Multi-host runtime: launcher detection, process-local batches, and a real two-process job on
127.0.0.1 through launch/multiprocess_cpu.sh (CPU collectives)."""

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from joyagents_jax import distributed, sharding
from tests.test_sharding import ROOT, run_python


@pytest.mark.parametrize("env, cluster", [
    ({}, "none"),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "explicit"),
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "none"),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "t0"}, "none"),
    ({"JOYAGENTS_CLUSTER": "tpu"}, "tpu"),
    ({"JOYAGENTS_CLUSTER": "none", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
      "SLURM_NTASKS": "4"}, "none"),
])
def test_detect_cluster(env, cluster):
    assert distributed.detect_cluster(env) == cluster


def test_detect_cluster_rejects_unknown_override():
    with pytest.raises(ValueError, match="JOYAGENTS_CLUSTER='k8s'; expected one of"):
        distributed.detect_cluster({"JOYAGENTS_CLUSTER": "k8s"})


def test_single_process_initialize_is_a_no_op(monkeypatch):
    root = logging.getLogger()  # initialize() configures logging; undo it afterwards
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    for name in ("JOYAGENTS_CLUSTER", "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID",
                 "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() == "none"
    assert not jax.distributed.is_initialized()
    assert distributed.is_primary()


def test_explicit_launch_needs_all_three(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError) as e:
        distributed.initialize(cluster="explicit")
    assert "missing ['coordinator_address', 'process_id']" in str(e.value)


def test_global_batch_single_process():
    mesh = sharding.make_mesh()
    rows = distributed.process_rows(mesh, 4)
    assert rows == slice(0, 4)
    batch = {"tokens": np.arange(12).reshape(4, 3)}
    out = distributed.global_batch(batch, mesh)
    np.testing.assert_array_equal(out["tokens"], batch["tokens"])
    assert out["tokens"].sharding.spec == sharding.batch_spec()


def test_primary_first_and_run_info_in_one_process(tmp_path):
    calls = []
    assert distributed.primary_first("t", lambda: calls.append(1) or "value") == "value"
    assert calls == [1]
    mesh = sharding.make_mesh("fsdp=-1")
    distributed.write_run_info(str(tmp_path), mesh)
    info = json.load(open(tmp_path / distributed.RUN_INFO))
    assert info == {"process_count": 1, "global_device_count": jax.device_count(),
                    "local_device_count": jax.local_device_count(),
                    "mesh": {"agent": 1, "data": 1, "fsdp": jax.device_count(), "tensor": 1},
                    "backend": "cpu"}


def local_batch_report() -> dict:
    """Runs with 8 fake devices: global arrays and the local-batch divisibility error."""
    mesh = sharding.make_mesh("data=2,fsdp=4")
    x = np.arange(16 * 3).reshape(16, 3)
    out = distributed.global_batch(x[distributed.process_rows(mesh, 16)], mesh)
    stacked = distributed.global_batch(np.stack([x, -x]), mesh, stacked=True)
    try:
        distributed.global_batch(x[:12], mesh)
        error = ""
    except sharding.ShardingError as e:
        error = str(e)
    return {"equal": bool((np.asarray(out) == x).all()),
            "stacked_equal": bool((np.asarray(stacked) == np.stack([x, -x])).all()),
            "shard": list(out.addressable_shards[0].data.shape),
            "stacked_shard": list(stacked.addressable_shards[0].data.shape), "error": error,
            "to_host": bool((distributed.to_host({"x": out})["x"] == x).all())}


def test_global_batch_on_8_devices():
    out = run_python("import json; from tests.test_distributed import local_batch_report; "
                     "print('REPORT' + json.dumps(local_batch_report()))")
    r = json.loads(out.split("REPORT", 1)[1])
    assert r["equal"] and r["stacked_equal"] and r["to_host"]
    assert r["shard"] == [2, 3] and r["stacked_shard"] == [2, 2, 3]
    assert r["error"] == ("Process 0 feeds 12 rows (dimension 0 of a local batch of shape "
                          "(12, 3)), not divisible by the 8 data-parallel shards on its devices; "
                          "feed a multiple of 8 rows per process.")


# Execs argv[1:] with SIGINT at its default: pytest started as a background job of a script
# ignores SIGINT, its children inherit that, and bash cannot trap a signal ignored on entry.
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


def start_group(cmd: list[str], env: dict) -> subprocess.Popen:
    """Starts `cmd` at the repo root in a session of its own, SIGINT at its default, stdout and
    stderr together."""
    return subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT, *cmd], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_session(sid: int) -> None:
    """SIGKILL to every process of session `sid`: the launcher puts each of its processes in a
    process group of its own."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def finish_group(proc: subprocess.Popen, timeout: float) -> str:
    """Its output once it ends; on timeout its whole session is killed and the test fails. Decoded
    by hand: text mode would split a progress bar's \r redraws into lines."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(proc.args)} did not finish in {timeout} s; output:\n"
                    f"{out.decode(errors='replace')[-6000:]}")
    return out.decode(errors="replace")


def _run_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    proc = start_group(cmd, env)
    out = finish_group(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def test_two_processes_agree_through_the_launch_script():
    env = {**os.environ, "PYTHON": sys.executable,
           "ENTRY": f"{sys.executable} -m joyagents_jax.distributed --timeout 60"}
    env.pop("XLA_FLAGS", None)
    proc = _run_group(["bash", "launch/multiprocess_cpu.sh", "-n", "2", "-d", "2"], env, 180)
    assert proc.returncode == 0, f"two-process job failed:\n{proc.stdout[-6000:]}"
    report = [line for line in proc.stdout.splitlines() if line.startswith("[p0] processes")]
    assert len(report) == 1, proc.stdout
    assert "processes 2, devices 4, global batch (8, 8)" in report[0]
    assert report[0].endswith(": OK")
    results = json.loads(report[0].split("process results ")[1].split(", expected")[0])
    assert len(results) == 2 and results[0] == results[1]
    # Only process 0 logs below ERROR. Matched on the log record's own format anywhere in a
    # line: gloo's C++ threads write unprefixed text that can interleave with other output.
    record = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING) ")
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("[p0]") and record.search(line)]
    assert not [line for line in lines if line.startswith("[p1]") and record.search(line)], \
        proc.stdout
    assert not [line for line in lines if line.startswith("[p1] processes")], proc.stdout


def _two_processes_of_one_device(tmp_path, source: str, timeout: float
                                 ) -> subprocess.CompletedProcess:
    """Python `source` as the entry point of 2 processes x 1 CPU device under the launcher."""
    script = tmp_path / "entry.py"
    script.write_text(source)
    env = {**os.environ, "PYTHON": sys.executable, "ENTRY": f"{sys.executable} {script}"}
    env.pop("XLA_FLAGS", None)
    return _run_group(["bash", "launch/multiprocess_cpu.sh", "-n", "2", "-d", "1", "--", "x"],
                      env, timeout)


# Each process: params as global arrays on an fsdp=2 mesh; their optimizer state from a jit that
# depends on no input value (host-local arrays), a host value and the params resharded, placed
# with `sharding.place`; every leaf's shards must be readable (as orbax reads them) and right.
_PLACE = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
from joyagents_jax import distributed, sharding
distributed.initialize()
mesh = sharding.make_mesh("fsdp=-1")
split, whole = NamedSharding(mesh, P("agent", "fsdp")), NamedSharding(mesh, P("agent"))
params = {"w": jax.jit(lambda: jnp.ones((2, 4, 3)), out_shardings=split)(),
          "s": jax.jit(lambda: jnp.full((2, 4), 2.0), out_shardings=whole)()}
tree = {"opt": jax.jit(jax.vmap(optax.adam(1e-3).init))(params), "host": np.arange(4.0),
        "params": params}
targets = {"opt": jax.tree.map(lambda _: whole, tree["opt"]), "host": whole,
           "params": {"w": whole, "s": split}}
placed = sharding.place(tree, targets)
want = {"opt": jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree["opt"]),
        "host": np.arange(4.0), "params": {"w": np.ones((2, 4, 3)), "s": np.full((2, 4), 2.0)}}
for (path, x), s, w in zip(jax.tree_util.tree_flatten_with_path(placed)[0],
                           jax.tree.leaves(targets), jax.tree.leaves(want)):
    shard = x.addressable_shards[0]  # raised for the optimizer state placed by device_put
    assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)
    assert np.array_equal(np.asarray(shard.data), w[shard.index]), jax.tree_util.keystr(path)
print(f"PLACED {jax.process_index()} {len(jax.tree.leaves(placed))}", flush=True)
"""


def test_values_placed_on_a_mesh_of_two_processes_with_one_device_each(tmp_path):
    """As a GPU cluster runs one process per device: the GRPO phase's fresh optimizer state
    placed with `device_put` had shards nobody could read, and orbax failed to save it."""
    proc = _two_processes_of_one_device(tmp_path, _PLACE, 120)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert sorted(re.findall(r"PLACED (\d) (\d+)", proc.stdout)) == [("0", "8"), ("1", "8")]


def test_launch_script_stops_everyone_when_one_fails(tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text("import os, sys, time\n"
                      "sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(120)\n")
    env = {**os.environ, "PYTHON": sys.executable, "ENTRY": f"{sys.executable} {script}"}
    proc = _run_group(["bash", "launch/multiprocess_cpu.sh", "-n", "3"], env, 60)
    assert proc.returncode == 3
    assert "process 1 exited with status 3; stopping the others" in proc.stdout
    assert "SIGKILL" not in proc.stdout  # they left on SIGTERM


# A `joyagents` subcommand that fails on process 1 while process 0 waits for it in a collective
# (as `train` does in `Guard.stop_agreed` after each step).
_FAIL_ALONE = """
import sys
import jax, numpy as np
from jax.experimental import multihost_utils
from joyagents_jax import cli, distributed

def fail_alone(argv):
    distributed.initialize()
    if jax.process_index() == 1:
        raise RuntimeError("the input only process 1 reads is missing")
    multihost_utils.process_allgather(np.ones(1))
    return 0

cli.COMMANDS["fail-alone"] = cli.Command("fails on process 1", fail_alone)
sys.exit(cli.main(["fail-alone"]))
"""


def test_a_command_that_fails_on_one_process_ends_the_job(tmp_path):
    """Process 1 leaves at once and the launcher stops process 0. Before, process 1 waited in
    jax.distributed's shutdown barrier until process 0's collective failed (here ~30 s; in
    `train`, whose process 0 then waits in orbax's barrier, 5 minutes and both aborted)."""
    proc = _two_processes_of_one_device(tmp_path, _FAIL_ALONE, 90)
    assert proc.returncode == 1, proc.stdout[-6000:]
    assert "[p1] RuntimeError: the input only process 1 reads is missing" in proc.stdout
    assert "process 1 exited with status 1; stopping the others" in proc.stdout


def test_launch_script_kills_the_others_a_grace_period_after_one_fails(tmp_path):
    # Processes stuck past SIGTERM (as `joyagents train` waits in a collective with a dead peer).
    script = tmp_path / "fail_one_ignore_term.py"
    script.write_text("import os, signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(120)\n")
    env = {**os.environ, "PYTHON": sys.executable, "ENTRY": f"{sys.executable} {script}"}
    proc = _run_group(["bash", "launch/multiprocess_cpu.sh", "-n", "3", "-g", "1"], env, 60)
    assert proc.returncode == 3
    assert "2 process(es) still running 1 s after SIGTERM; sending SIGKILL" in proc.stdout


def test_launch_script_refuses_a_grace_that_is_not_whole_seconds():
    proc = _run_group(["bash", "launch/multiprocess_cpu.sh", "-g", "2.5", "check-cluster"],
                      {**os.environ, "PYTHON": sys.executable}, 60)
    assert proc.returncode == 2
    assert "-g GRACE takes whole seconds, got '2.5'" in proc.stdout


# A process that handles SIGINT/SIGTERM as `joyagents train` does (preemption.Guard): the first
# signal makes it save and leave, a second one ends it at once.
GUARDED = """import os, signal, sys, time
got = []
def handle(signum, frame):
    if got:
        print("killed by a second signal", flush=True)
        os._exit(9)
    got.append(signum)
signal.signal(signal.SIGTERM, handle)
signal.signal(signal.SIGINT, handle)
print("ready", flush=True)
while not got:
    time.sleep(0.05)
print("saving after", signal.Signals(got[0]).name, flush=True)
time.sleep(float(sys.argv[1]))
print("saved", flush=True)
if len(sys.argv) > 2:  # a record that outlives a closed terminal
    with open(sys.argv[2], "a") as f:
        f.write(f"p{os.environ['JAX_PROCESS_ID']} saved after {signal.Signals(got[0]).name}\\n")
"""


def _read_until(proc: subprocess.Popen, marker: bytes, count: int, out: bytes = b"",
                timeout: float = 60) -> bytes:
    """`out` and what `proc` prints next, up to the point where `marker` has appeared `count`
    times; after `timeout` s its session is killed and the test fails."""
    deadline = time.monotonic() + timeout
    while out.count(marker) < count:
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            _kill_session(proc.pid)
            pytest.fail(f"{marker!r} did not appear {count} times in {timeout} s:\n"
                        f"{out.decode()}")
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk, f"the job ended before {marker!r} appeared {count} times:\n{out.decode()}"
        out += chunk
    return out


def _start_guarded(tmp_path, save_s: float) -> tuple[subprocess.Popen, bytes]:
    """Two GUARDED processes under the launcher, once both have their handlers; what they
    printed so far."""
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED)
    env = {**os.environ, "PYTHON": sys.executable, "ENTRY": f"{sys.executable} {script}"}
    proc = start_group(["bash", "launch/multiprocess_cpu.sh", "-n", "2", str(save_s)], env)
    return proc, _read_until(proc, b"ready", 2)


def test_ctrl_c_lets_every_process_save_once_and_leave(tmp_path):
    proc, seen = _start_guarded(tmp_path, save_s=1.0)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher's process group
    out = seen.decode() + finish_group(proc, 60)
    assert proc.returncode == 130, out
    for i in range(2):
        assert f"[p{i}] saving after SIGTERM" in out and f"[p{i}] saved" in out, out
    assert "second signal" not in out


def test_a_closed_terminal_lets_every_process_save_once_and_leave(tmp_path,
                                                                 spawn_on_a_terminal):
    """As a dropped ssh session: the launcher leads a session whose terminal closes. Before,
    SIGHUP killed the launcher and left its processes running unsaved; the prefixer of the one
    that printed died on the terminal's EIO."""
    script, record = tmp_path / "guarded.py", tmp_path / "record.txt"
    script.write_text(GUARDED)
    env = {**os.environ, "PYTHON": sys.executable, "ENTRY": f"{sys.executable} {script}"}
    pid, master = spawn_on_a_terminal(
        ["/bin/bash", os.path.join(ROOT, "launch/multiprocess_cpu.sh"), "-n", "2", "1.0",
         str(record)], env)
    seen, deadline = b"", time.monotonic() + 60
    while seen.count(b"ready") < 2:
        assert time.monotonic() < deadline, seen.decode(errors="replace")
        if select.select([master], [], [], 1)[0]:
            seen += os.read(master, 65536)
    os.close(master)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 129
    assert sorted(record.read_text().splitlines()) == ["p0 saved after SIGTERM",
                                                       "p1 saved after SIGTERM"]


def test_a_second_ctrl_c_kills_the_processes(tmp_path):
    proc, seen = _start_guarded(tmp_path, save_s=120.0)
    os.killpg(proc.pid, signal.SIGINT)
    seen = _read_until(proc, b"saving after SIGTERM", 2, seen)  # the first reached both
    os.killpg(proc.pid, signal.SIGINT)
    out = seen.decode() + finish_group(proc, 60)
    assert "interrupted again; sending SIGKILL" in out
    assert "[p0] saved" not in out and "[p1] saved" not in out


def _fake_tools(tmp_path, *names: str) -> dict:
    """An environment whose PATH has `names` as stubs that print their arguments."""
    for name in names:
        stub = tmp_path / name
        stub.write_text('#!/bin/bash\n'
                        'echo "$0 JOYAGENTS_CLUSTER=${JOYAGENTS_CLUSTER:-} '
                        'JAX_LOCAL_DEVICE_IDS=${JAX_LOCAL_DEVICE_IDS:-}"\n'
                        'printf "[%s]" "$@"; echo\n')
        stub.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}


def test_tpu_pod_script_runs_the_entry_point_on_every_worker(tmp_path):
    env = _fake_tools(tmp_path, "gcloud")
    out = subprocess.run(["bash", "launch/tpu_pod.sh", "my-tpu", "us-east5-a", "--project", "p",
                          "plan", "--config", "7b+3b"], cwd=ROOT, env=env, text=True,
                         capture_output=True, check=True).stdout
    assert ("[compute][tpus][tpu-vm][ssh][my-tpu][--zone][us-east5-a][--project][p]"
            "[--worker=all][--command][cd joyagents_jax && JOYAGENTS_CLUSTER=tpu python3 -m "
            "joyagents_jax.cli plan --config 7b+3b ]") in out


@pytest.mark.parametrize("tasks_per_node, device_ids", [("1", "0,1,2,3"), ("4", "")])
def test_slurm_script_runs_the_entry_point_under_srun(tmp_path, tasks_per_node, device_ids):
    env = _fake_tools(tmp_path, "srun") | {"SLURM_GPUS_ON_NODE": "4",
                                          "SLURM_NTASKS_PER_NODE": tasks_per_node}
    out = subprocess.run(["bash", "launch/slurm_gpu.sbatch", "plan", "--mesh", "fsdp=-1"],
                         cwd=ROOT, env=env, text=True, capture_output=True, check=True).stdout
    assert f"JOYAGENTS_CLUSTER=slurm JAX_LOCAL_DEVICE_IDS={device_ids}\n" in out
    assert "[--kill-on-bad-exit=1][python][-m][joyagents_jax.cli][plan][--mesh][fsdp=-1]" in out
