"""Multi-host runtime: start JAX's distributed system, feed process-local batches, log once.

A multi-host job runs the same program in one process per host (TPU VM worker) or per node or
GPU (SLURM task). `initialize()` connects the processes, after which `jax.devices()` lists
every device of the job and one `Mesh` spans them all. Each process then loads only the rows of
the global batch that its own devices hold (`process_rows`) and `global_batch` assembles the
process-local pieces into global arrays without any host-to-host copy.

`python -m joyagents_jax.distributed` is a cluster check: it initializes, builds a global
batch from process-local slices, runs a jitted sharded computation and verifies that every
process got the same, correct answer. The launch scripts run it like any other entry point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from joyagents_jax import sharding

CLUSTERS = ("auto", "explicit", "slurm", "tpu", "none")
RUN_INFO = "run_info.json"
log = logging.getLogger("joyagents")
T = TypeVar("T")


def detect_cluster(env: Mapping[str, str] = os.environ) -> str:
    """How this process was launched: explicit, slurm, tpu, or none (a single process).

    `JOYAGENTS_CLUSTER` (set by the launch scripts) wins. Explicit means a coordinator address
    in `JAX_COORDINATOR_ADDRESS`. A Cloud TPU VM pod started over ssh is not visible in the
    environment, so `launch/tpu_pod.sh` sets `JOYAGENTS_CLUSTER=tpu`.
    """
    chosen = env.get("JOYAGENTS_CLUSTER", "auto")
    if chosen not in CLUSTERS:
        raise ValueError(f"JOYAGENTS_CLUSTER={chosen!r}; expected one of {CLUSTERS}.")
    if chosen != "auto":
        return chosen
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "explicit"
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        return "slurm"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return "none"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
               *, cluster: str = "auto", timeout_s: int = 300) -> str:
    """Starts `jax.distributed` for the detected launcher; returns the launcher's name.

    Call it first, before any JAX computation. Explicit arguments (or the environment variables
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) select an explicit launch;
    SLURM and TPU pods are detected (or named by `cluster`). A single process does nothing.
    Afterwards only process 0 logs at INFO; the others log errors only.
    """
    if any(a is not None for a in (coordinator_address, num_processes, process_id)):
        cluster = "explicit"
    elif cluster == "auto":
        cluster = detect_cluster()
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster={cluster!r}; expected one of {CLUSTERS}.")
    if cluster != "none" and not jax.distributed.is_initialized():
        if cluster == "explicit":
            args = _explicit_args(coordinator_address, num_processes, process_id)
        else:  # JAX reads SLURM's variables or the TPU VM metadata itself
            args = {"cluster_detection_method": "slurm" if cluster == "slurm" else None}
        jax.distributed.initialize(**args, local_device_ids=local_device_ids,
                                   initialization_timeout=timeout_s)
    configure_logging()
    how = "single process" if cluster == "none" else f"jax.distributed ({cluster} launch)"
    log.info("%s: process %d of %d, %d local of %d %s devices", how, jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count(),
                 jax.devices()[0].platform)
    return cluster


def _explicit_args(address: str | None, count: int | None, index: int | None) -> dict[str, Any]:
    env = os.environ
    args = {"coordinator_address": address or env.get("JAX_COORDINATOR_ADDRESS"),
            "num_processes": count if count is not None else env.get("JAX_NUM_PROCESSES"),
            "process_id": index if index is not None else env.get("JAX_PROCESS_ID")}
    missing = [k for k, v in args.items() if v is None]
    if missing:
        raise ValueError(f"An explicit multi-process launch needs coordinator_address, "
                         f"num_processes and process_id (or JAX_COORDINATOR_ADDRESS, "
                         f"JAX_NUM_PROCESSES, JAX_PROCESS_ID); missing {missing}.")
    return {**args, "num_processes": int(args["num_processes"]),
            "process_id": int(args["process_id"])}


def is_primary() -> bool:
    """Process 0: the one that logs, writes metrics and prints."""
    return jax.process_index() == 0


def configure_logging(level: int = logging.INFO) -> None:
    """Our INFO logs on process 0, errors only elsewhere (so N hosts do not print N copies).

    Other libraries keep the root logger's level (orbax's INFO records stay out of the log).
    """
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s")
    if is_primary():
        log.setLevel(level)
    else:
        logging.getLogger().setLevel(logging.ERROR)
        log.setLevel(logging.ERROR)


def to_host(tree: Any) -> Any:
    """Every array of `tree` as numpy, whole, on every process: a global array sharded over
    other processes' devices is gathered (a collective: call it on every process)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def leave(status: int) -> None:
    """Ends this process of a multi-process job now, with `status`, its output flushed.

    For a process that failed alone: a normal exit waits in jax.distributed's shutdown barrier
    for peers that may be blocked in a collective with it, and after 5 minutes every process
    aborts with 'Shutdown barrier has failed'. Leaving at once lets the launcher stop the others
    (launch/multiprocess_cpu.sh, srun), or the peers' heartbeat timeout end them.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def barrier(name: str) -> None:
    """Every process waits here until all arrive (nothing to do for a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def primary_first(name: str, fn: Callable[[], T]) -> T:
    """`fn()` on process 0, then on the others once it returned: for work that writes shared
    files (preparing a dataset, moving a workdir aside) and leaves them for the rest to read."""
    out = fn() if is_primary() else None
    barrier(name)
    return out if is_primary() else fn()


def run_info(mesh: jax.sharding.Mesh | None) -> dict[str, Any]:
    """What this job runs on: processes, devices, mesh axis sizes, backend."""
    return {"process_count": jax.process_count(), "global_device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "mesh": dict(mesh.shape) if mesh is not None else {},
            "backend": jax.default_backend()}


def write_run_info(workdir: str, mesh: jax.sharding.Mesh | None) -> None:
    """`<workdir>/run_info.json` (process 0 only), replaced atomically."""
    if not is_primary():
        return
    path = os.path.join(workdir, RUN_INFO)
    with open(path + ".tmp", "w") as f:
        json.dump(run_info(mesh), f, indent=2)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------------
# Process-local data.
# ----------------------------------------------------------------------------------------------

def _local_spans(mesh: jax.sharding.Mesh, rows: int) -> set[tuple[int, int]]:
    """(start, stop) of the batch shards on this process's devices, for a batch of `rows`."""
    index_map = sharding.batch_sharding(mesh).addressable_devices_indices_map((rows,))
    return {ix[0].indices(rows)[:2] for ix in index_map.values()}


def process_rows(mesh: jax.sharding.Mesh, global_batch: int) -> slice:
    """The rows of a [global_batch, ...] batch that this process's devices hold.

    A data pipeline loads exactly these rows; `global_batch` then assembles the global array.
    """
    sharding.check_batch(mesh.shape, global_batch)
    spans = _local_spans(mesh, global_batch)
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    if sum(e - s for s, e in spans) != stop - start:
        raise sharding.ShardingError(
            f"Process {jax.process_index()} holds non-contiguous batch rows {sorted(spans)}; "
            f"build the mesh with sharding.make_mesh so devices are in process order.")
    return slice(start, stop)


def global_batch(local: Any, mesh: jax.sharding.Mesh, stacked: bool = False) -> Any:
    """This process's rows ([B_local, ...], or [A, B_local, ...] if stacked) -> global arrays.

    Every process passes the rows that `process_rows` names; the result is sharded over
    data×fsdp (and over the agent axis when stacked).
    """
    batch_sharding = sharding.batch_sharding(mesh, stacked)
    axis = int(stacked)
    shards = len(_local_spans(mesh, sharding.data_parallel_size(mesh.shape)))

    def one(x):
        x = np.asarray(x)
        if x.shape[axis] % shards:
            raise sharding.ShardingError(
                f"Process {jax.process_index()} feeds {x.shape[axis]} rows (dimension {axis} of "
                f"a local batch of shape {x.shape}), not divisible by the {shards} data-parallel "
                f"shards on its devices; feed a multiple of {shards} rows per process.")
        return jax.make_array_from_process_local_data(batch_sharding, x)

    return jax.tree.map(one, local)


# ----------------------------------------------------------------------------------------------
# Cluster check.
# ----------------------------------------------------------------------------------------------

def check(mesh: jax.sharding.Mesh, rows_per_shard: int = 2, features: int = 8) -> dict[str, Any]:
    """Global batch from process-local slices -> jitted sharded computation -> all agree.

    Returns every process's result (gathered to all) and the single-host numpy answer.
    """
    dp = sharding.data_parallel_size(mesh.shape)
    b = rows_per_shard * dp
    data = np.arange(b * features, dtype=np.float32).reshape(b, features) / (b * features)
    rows = process_rows(mesh, b)
    x = global_batch(data[rows], mesh)
    w_host = np.linspace(-1, 1, features * 4, dtype=np.float32).reshape(features, 4)
    w = jax.device_put(w_host, jax.sharding.NamedSharding(mesh, sharding.P(None, "tensor")))
    replicated = jax.sharding.NamedSharding(mesh, sharding.P())

    def score(x, w):  # a reduction over the batch: needs every process's rows
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    result = jax.jit(score, out_shardings=replicated)(x, w)
    mine = np.asarray(result.addressable_shards[0].data, np.float64)  # this process's copy
    expected = float(np.sum(np.tanh(data @ w_host) ** 2))
    gathered = multihost_utils.process_allgather(mine)  # [processes]
    return {"process_results": np.asarray(gathered).reshape(-1).tolist(), "expected": expected,
            "rows": (rows.start, rows.stop), "global_shape": x.shape,
            "batch_to_host": bool(np.array_equal(to_host(x), data))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="joyagents check-cluster",
        description="Cluster check: initialize, feed process-local data, agree on a result.")
    parser.add_argument("--mesh", default="fsdp=-1", help="axis sizes, e.g. data=2,fsdp=-1")
    parser.add_argument("--cluster", choices=CLUSTERS, default="auto")
    parser.add_argument("--timeout", type=int, default=120, help="seconds to wait for peers")
    args = parser.parse_args(argv)
    initialize(cluster=args.cluster, timeout_s=args.timeout)
    out = check(sharding.make_mesh(args.mesh))
    ok = all(np.isclose(r, out["expected"], rtol=1e-5) for r in out["process_results"])
    ok = ok and out["batch_to_host"]  # every process read the whole batch back
    if is_primary():
        print(f"processes {jax.process_count()}, devices {jax.device_count()}, global batch "
              f"{out['global_shape']}; process results {out['process_results']}, "
              f"expected {out['expected']:.6f}: {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
