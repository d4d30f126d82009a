"""The portable CPU numerics flags: added once, never over a flag the user set, switchable off;
the compilation cache: on by default, in the user's cache folder unless the user names one;
threads for a host split into devices: enough that back-to-back collectives finish."""

import os
import subprocess
import sys

import numpy as np

from joyagents_jax import xla_flags


def test_flags_are_added_to_what_the_user_set():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    xla_flags.pin_cpu_numerics(env)
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8", *xla_flags.PORTABLE,
        "--xla_backend_extra_options=xla_cpu_disable_platform_dependent_math"]
    pinned = env["XLA_FLAGS"]
    xla_flags.pin_cpu_numerics(env)  # idempotent
    assert env["XLA_FLAGS"] == pinned


def test_a_users_own_value_wins_and_the_switch_turns_it_off():
    env = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX512"}
    xla_flags.pin_cpu_numerics(env)
    assert env["XLA_FLAGS"].split() == [
        "--xla_cpu_max_isa=AVX512", "--xla_cpu_experimental_ynn_fusion_type=",
        "--xla_backend_extra_options=xla_cpu_disable_platform_dependent_math"]
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    env = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    xla_flags.pin_cpu_numerics(env)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    env = {xla_flags.SWITCH: "0"}
    xla_flags.pin_cpu_numerics(env)
    assert env == {xla_flags.SWITCH: "0"}


def test_the_users_backend_options_are_kept_beside_the_portable_ones():
    env = {"XLA_FLAGS": "--xla_backend_extra_options=xla_llvm_dot_tiling_factor=4 --xla_dump_to=d"}
    xla_flags.pin_cpu_numerics(env)
    flags = env["XLA_FLAGS"].split()
    assert flags[-1] == ("--xla_backend_extra_options=xla_llvm_dot_tiling_factor=4,"
                         "xla_cpu_disable_platform_dependent_math")
    assert sum(f.startswith(xla_flags.EXTRA_OPTIONS) for f in flags) == 1
    assert "--xla_dump_to=d" in flags
    env = {"XLA_FLAGS": "--xla_backend_extra_options=xla_cpu_disable_platform_dependent_math"}
    xla_flags.pin_cpu_numerics(env)
    assert env["XLA_FLAGS"].count("xla_cpu_disable_platform_dependent_math") == 1


def test_pinned_numerics_compute_rsqrt_exactly_and_matmuls_outside_ynnpack(tmp_path):
    """In a fresh process with the pinned flags: rsqrt equals 1 / sqrt to the bit (the
    hardware estimate does not), and the compiled matmul runs outside YNNPACK."""
    code = (
        "import numpy as np, jax, jax.numpy as jnp\n"
        "x = jnp.asarray(np.random.default_rng(0).uniform(0.1, 9.0, 4096), jnp.float32)\n"
        "r = np.asarray(jax.jit(jax.lax.rsqrt)(x))\n"
        "print(np.array_equal(r, np.float32(1) / np.sqrt(np.asarray(x))))\n"
        "a = jnp.ones((64, 96)); b = jnp.ones((96, 80))\n"
        "print('__ynn_fusion' in jax.jit(jnp.matmul).lower(a, b).compile().as_text())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_flags.SWITCH)}
    env[xla_flags.CACHE_DIR] = ""
    xla_flags.pin_cpu_numerics(env)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.split()
    assert out == ["True", "False"]


def test_the_compilation_cache_defaults_to_the_users_cache_folder(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == str(tmp_path / "joyagents" / "xla")
    assert os.path.isdir(env[xla_flags.CACHE_DIR])
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.2"
    assert xla_flags.default_cache_dir({}) == os.path.join(os.path.expanduser("~"), ".cache",
                                                          "joyagents", "xla")


def test_a_users_cache_setting_wins_and_an_empty_one_turns_it_off(tmp_path):
    env = {xla_flags.CACHE_DIR: "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "5"}
    xla_flags.use_compilation_cache(env)
    assert env == {xla_flags.CACHE_DIR: "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "5"}
    env = {xla_flags.CACHE_DIR: str(tmp_path / "mine")}
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == str(tmp_path / "mine")


def test_an_unwritable_cache_folder_is_reported_once_and_turned_off(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    env = {xla_flags.CACHE_DIR: str(tmp_path / "a_file" / "xla")}
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == ""
    assert "cannot create or write the compilation cache folder" in capsys.readouterr().err
    env = {xla_flags.CACHE_DIR: "gs://bucket/xla"}  # remote stores are JAX's to open
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == "gs://bucket/xla"


def _devices(n: int) -> str:
    return f"{xla_flags.DEVICE_COUNT_FLAG}{n}"


def test_the_device_count_comes_from_xla_flags_or_jax_num_cpu_devices():
    assert xla_flags.forced_cpu_devices({}) == 1
    flags = "--xla_force_host_platform_device_count=2 --xla_force_host_platform_device_count=8"
    assert xla_flags.forced_cpu_devices({"XLA_FLAGS": flags}) == 8
    assert xla_flags.forced_cpu_devices({"XLA_FLAGS": flags, "JAX_NUM_CPU_DEVICES": "4"}) == 4
    assert xla_flags.forced_cpu_devices({"XLA_FLAGS": _devices(0)}) == 1
    assert xla_flags.forced_cpu_devices({"JAX_NUM_CPU_DEVICES": "x"}) == 1


def test_a_users_nproc_below_two_threads_per_device_is_kept_and_warned_about(capsys):
    env = {"XLA_FLAGS": _devices(8), xla_flags.THREADS: "3"}
    xla_flags.enough_cpu_threads(env)
    assert env[xla_flags.THREADS] == "3"
    err = capsys.readouterr().err
    assert "NPROC=3 gives XLA fewer than 2 CPU threads per device (8 devices)" in err
    assert "unset NPROC or set it to" in err
    env = {"XLA_FLAGS": _devices(8), xla_flags.THREADS: "16"}
    xla_flags.enough_cpu_threads(env)
    assert capsys.readouterr().err == ""


def test_several_devices_get_threads_per_device_unless_the_user_set_nproc():
    env = {"XLA_FLAGS": _devices(8)}
    xla_flags.enough_cpu_threads(env)
    cores = len(os.sched_getaffinity(0))
    assert env[xla_flags.THREADS] == str(max(cores, 8 * xla_flags.THREADS_PER_DEVICE))
    env = {"XLA_FLAGS": _devices(8), xla_flags.THREADS: "16"}
    xla_flags.enough_cpu_threads(env)
    assert env[xla_flags.THREADS] == "16"
    env = {"XLA_FLAGS": _devices(1)}
    xla_flags.enough_cpu_threads(env)
    assert xla_flags.THREADS not in env


# A scan whose body gathers fsdp-split weights, and an all-reduce over every device that does
# not depend on it, called back to back: with one pool thread per core, eight devices on a
# two-core host deadlock within the first calls and XLA aborts the process.
_COLLECTIVES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
def f(w, x, mask):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h * mask[..., None]) / jnp.sum(mask)
put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
w = put(np.full((4, 64, 64), 0.01, np.float32), P(None, "fsdp"))
x = put(np.ones((16, 32, 64), np.float32), P(("data", "fsdp")))
mask = put(np.ones((16, 32), np.int32), P(("data", "fsdp")))
g = jax.jit(f, out_shardings=NamedSharding(mesh, P()))
outs = [g(w, x, mask) for _ in range(300)]
print(float(outs[-1]))
"""


def test_eight_devices_run_collectives_back_to_back_without_a_deadlock():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": _devices(8) + " --xla_cpu_collective_call_terminate_timeout_seconds=20"}
    env.pop(xla_flags.THREADS, None)
    xla_flags.enough_cpu_threads(env)
    proc = subprocess.run([sys.executable, "-c", _COLLECTIVES], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    h = 1.0
    for _ in range(4):  # every unit of a layer sums 64 inputs h times 0.01
        h = np.tanh(0.64 * h)
    assert abs(float(proc.stdout) - 64 * h) < 1e-4  # the mean of a position's 64-unit sum
