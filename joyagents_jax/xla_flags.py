"""XLA CPU flags that narrow how much a run's float results depend on the x86-64 CPU running it.

XLA's CPU backend lets the host's CPU choose arithmetic in several places, each enough for
hundreds of training steps to turn last-bit differences into different accuracies
(benchmarks/RESULTS.md, "Reproducibility" and "What the CPU still chose"): matmuls run as
YNNPACK fusions whose kernels are picked by the CPU's features at run time; with those fusions
off they go to Eigen, whose f32 inner kernel is oneDNN's sgemm, again picked by the CPU (capped
by `ONEDNN_MAX_CPU_ISA`); `rsqrt` (the RMSNorm) is the hardware estimate refined by one Newton
step on AMD and two on Intel; the rest is compiled for the host's widest vector ISA. `PORTABLE`
turns YNNPACK off, caps XLA's ISA and oneDNN's at AVX2, and computes `rsqrt` as 1 / sqrt.
YNNPACK's consistent-arithmetic mode would pin its matmuls too, but it sends some bf16 dots to a
thunk that rejects them and changes the gradients of agents trained in passes. Eigen still sizes
its blocks by the CPU's caches, so CPUs may still part. Set `JOYAGENTS_PORTABLE_CPU_NUMERICS=0`
to keep XLA's defaults. Imports nothing from JAX: call `pin_cpu_numerics()` before JAX starts
its backend.

`use_compilation_cache()` points JAX's persistent compilation cache at a folder kept between
runs, so a rerun, a resumed run or the next seed loads what an earlier run compiled.

`enough_cpu_threads()` gives XLA's CPU thread pools room for a host split into several devices
(`--xla_force_host_platform_device_count`), where too few threads deadlock collectives."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

PORTABLE = ("--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_max_isa=AVX2")
PORTABLE_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2"}  # read when oneDNN first runs
EXTRA_OPTIONS = "--xla_backend_extra_options"  # comma-separated backend options
PORTABLE_OPTIONS = ("xla_cpu_disable_platform_dependent_math",)
SWITCH = "JOYAGENTS_PORTABLE_CPU_NUMERICS"
CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
# Programs that compile faster than this are not worth a file (the default's eager ops).
CACHE_MIN_COMPILE_SECS = ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
THREADS = "NPROC"  # XLA and absl size their CPU thread pools by it when it is set
THREADS_PER_DEVICE = 4
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="


def pin_cpu_numerics(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds the `PORTABLE` flags to XLA_FLAGS, except those the user already set, the
    `PORTABLE_OPTIONS` to the backend options (the user's own options are kept), and the
    `PORTABLE_ENV` variables the user did not set."""
    if environ.get(SWITCH, "1") == "0":
        return
    for key, value in PORTABLE_ENV.items():
        environ.setdefault(key, value)
    flags = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in flags}
    flags += [f for f in PORTABLE if f.split("=", 1)[0] not in names]
    extra = [i for i, f in enumerate(flags) if f.split("=", 1)[0] == EXTRA_OPTIONS]
    options = [o for o in flags.pop(extra[-1]).partition("=")[2].split(",") if o] if extra else []
    keys = {o.split("=", 1)[0] for o in options}
    options += [o for o in PORTABLE_OPTIONS if o.split("=", 1)[0] not in keys]
    flags.append(f"{EXTRA_OPTIONS}={','.join(options)}")
    environ["XLA_FLAGS"] = " ".join(flags)


def forced_cpu_devices(environ: Mapping[str, str] = os.environ) -> int:
    """The CPU device count XLA_FLAGS or JAX_NUM_CPU_DEVICES ask for (the last flag wins); 1."""
    counts = [f[len(DEVICE_COUNT_FLAG):] for f in environ.get("XLA_FLAGS", "").split()
              if f.startswith(DEVICE_COUNT_FLAG)]
    count = environ.get("JAX_NUM_CPU_DEVICES") or (counts[-1] if counts else "1")
    return max(1, int(count)) if count.lstrip("-").isdigit() else 1


def enough_cpu_threads(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets NPROC to THREADS_PER_DEVICE threads per forced CPU device (at least the host's
    cores), unless the user set it or the host is one device.

    XLA:CPU runs a collective by parking a pool thread until every device arrives, and the pools
    have one thread per core. Eight devices on two cores then deadlock (measured, "Collectives
    on a host split into devices" in benchmarks/RESULTS.md): a device parks its thread in an
    all-reduce while the loop that other devices wait on in their own collectives has no thread
    left to run, and XLA aborts the process after its 40 s rendezvous timeout. Twice as many
    threads as devices ended it in a micro-benchmark; four leave room for nested loops. A user's
    NPROC below twice the devices is kept and warned about. Call it before JAX starts its
    backend."""
    devices = forced_cpu_devices(environ)
    if devices <= 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    wanted = max(cores or 1, THREADS_PER_DEVICE * devices)
    if THREADS not in environ:
        environ[THREADS] = str(wanted)
    elif not environ[THREADS].isdigit() or int(environ[THREADS]) < 2 * devices:
        print(f"joyagents: {THREADS}={environ[THREADS]} gives XLA fewer than 2 CPU threads per "
              f"device ({devices} devices), so its collectives may deadlock; unset {THREADS} or "
              f"set it to {wanted}", file=sys.stderr)


def default_cache_dir(environ: MutableMapping[str, str] = os.environ) -> str:
    """`$XDG_CACHE_HOME/joyagents/xla`, or `~/.cache/joyagents/xla`."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "joyagents", "xla")


def _writable(folder: str) -> bool:
    if "://" in folder:  # a remote store such as gs://: JAX opens it itself
        return True
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def use_compilation_cache(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turns on JAX's persistent compilation cache in `default_cache_dir()`, unless the user set
    `JAX_COMPILATION_CACHE_DIR` (their folder; "" turns the cache off).

    A loaded executable is the one that was compiled, so no number changes; JAX keys entries by
    the program, its XLA flags, devices and versions, and XLA refuses one compiled for CPU
    features this host lacks. A folder that cannot be created or written is reported once and
    the run goes on without the cache. The folder is never pruned (JAX evicts only with
    `JAX_COMPILATION_CACHE_MAX_SIZE` and the `filelock` package): delete it to reclaim space.
    JAX reads these variables when imported; a process that imported it already gets its
    config updated instead."""
    environ.setdefault(CACHE_DIR, default_cache_dir(environ))
    environ.setdefault(*CACHE_MIN_COMPILE_SECS)
    folder = environ[CACHE_DIR]
    if folder and not _writable(folder):  # else JAX warns at every compile
        print(f"joyagents: cannot create or write the compilation cache folder {folder}; running "
              f"without the cache (set JAX_COMPILATION_CACHE_DIR to a writable folder, or to '' "
              f"to turn it off quietly)", file=sys.stderr)
        environ[CACHE_DIR] = ""
    if "jax" in sys.modules and environ is os.environ:
        import jax

        jax.config.update("jax_compilation_cache_dir", environ[CACHE_DIR] or None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(environ[CACHE_MIN_COMPILE_SECS[0]]))
