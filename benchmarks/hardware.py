"""This machine's own limits, measured with JAX: matmul peak (FLOP/s) and memory bandwidth (B/s).

They are the denominators of every efficiency ratio in `benchmarks/` (no datasheet numbers).
Run alone: `python benchmarks/hardware.py [MxKxN ...]` (the rate of matmuls of those shapes too,
e.g. a decode step's, against the square peak).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp


def best_time(fn, *args, repeats: int = 5) -> float:
    """Best wall time of `fn(*args)` over `repeats` runs, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def _on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def matmul_rate(m: int, k: int, n: int, dtype=jnp.float32) -> float:
    """FLOP/s of one [m, k] @ [k, n] matmul."""
    a = jax.random.normal(jax.random.key(0), (m, k), dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), dtype)
    repeats = 5 if _on_cpu() else 50  # a GPU's product takes ~1 ms: more draws, a steadier best
    return 2 * m * k * n / best_time(jax.jit(jnp.matmul), a, b, repeats=repeats)


def matmul_peak(dtype=jnp.float32, n: int | None = None) -> float:
    """FLOP/s of a square [n, n] @ [n, n] matmul: the best this backend does on dense math.
    n defaults to 2048 on a CPU and 8192 on an accelerator (smaller ones leave a GPU idle)."""
    n = n or (2048 if _on_cpu() else 8192)
    return matmul_rate(n, n, n, dtype)


def memory_bandwidth(mbytes: int | None = None) -> float:
    """Bytes/s of a streaming reduction over a buffer far larger than the caches (512 MiB on a
    CPU, 4 GiB on an accelerator, whose caches reach tens of MiB)."""
    mbytes = mbytes or (512 if _on_cpu() else 4096)
    x = jnp.ones((mbytes << 20) // 4, jnp.float32)
    return x.nbytes / best_time(jax.jit(jnp.sum), x)


def device_name() -> str:
    """The first device in words, e.g. 'NVIDIA H100 80GB HBM3' or, on the CPU, its model name,
    family and model numbers, core count and widest vector ISA ('cpu: AMD EPYC family 26 model
    2, 2 cores, AVX-512'): CPU ratios differ between hosts (three "AMD EPYC" hosts of this
    project differ 6x in matmul peak), so each keeps its record."""
    d = jax.devices()[0]
    if d.platform != "cpu":
        return getattr(d, "device_kind", d.platform)
    model, flags = platform.processor() or "unknown model", set()
    if os.path.exists("/proc/cpuinfo"):
        first = {}  # the first processor's entries
        with open("/proc/cpuinfo") as f:
            for key, value in (line.split(":", 1) for line in f if ":" in line):
                first.setdefault(key.strip(), value.strip())
        model = first.get("model name", model)
        if "cpu family" in first and "model" in first:
            model += f" family {first['cpu family']} model {first['model']}"
        flags = set(first.get("flags", "").split())
    isa = next((f", {name}" for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"))
                if flag in flags), "")
    return f"cpu: {model}, {os.cpu_count()} cores{isa}"


def git_commit() -> str:
    """The short commit of this checkout ("unknown" outside git), so a record names its code."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def record_results(path: str, records: list[dict], setting: dict) -> None:
    """Merges `records` into the JSON list at `path`: a record replaces the one of the same
    model, device and setting (the fields named in `setting`, which maps each to its value in
    older records that lack it), so other sizes, hosts and settings accumulate. Each record
    gets the command and date."""
    key = lambda r: (r["model"], r["device"], *(r.get(k, v) for k, v in setting.items()))
    stamp = {"device": device_name(), "command": " ".join(["python"] + sys.argv),
             "date": datetime.date.today().isoformat()}
    records = [{**r, **stamp} for r in records]
    new = {key(r) for r in records}
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = [r for r in json.load(f) if key(r) not in new]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(old + records, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    print(f"devices: {jax.devices()}")
    peak = matmul_peak(jnp.float32)
    print(f"matmul peak f32:  {peak / 1e9:8.1f} GFLOP/s")
    print(f"matmul peak bf16: {matmul_peak(jnp.bfloat16) / 1e9:8.1f} GFLOP/s")
    print(f"memory bandwidth: {memory_bandwidth() / 1e9:8.1f} GB/s")
    for shape in sys.argv[1:]:
        m, k, n = map(int, shape.split("x"))
        rate = matmul_rate(m, k, n)
        print(f"matmul {shape} f32: {rate / 1e9:8.1f} GFLOP/s ({100 * rate / peak:.0f}% of the peak)")
