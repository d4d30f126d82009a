"""A run's workdir, checked before any work: not in use by another run, writable, compatible
with the run saved there, finished or not, and set aside on an explicit restart.

Nothing here imports JAX or builds data, so a bad workdir fails within a second of the start,
and nothing in the workdir is changed before the checks pass.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import ml_collections

CONFIG, FINAL_EVAL, CHECKPOINTS, LOCK = ("config.json", "final_eval.json", "checkpoints",
                                        "train.lock")
HANGUP_LOG = "train.hangup.log"  # a run's output after its terminal closed (preemption.Guard)
# Keys that shape the checkpointed arrays: a resume under other values cannot restore them.
ARRAY_KEYS = ("agents", "groups", "param_dtype", "tokenizer", "memory.enabled",
              "memory.capacity", "memory.response_len", "memory.request_len")
RUN_FILES = (CHECKPOINTS, "metrics.jsonl", "tb", "plots", FINAL_EVAL, HANGUP_LOG)


class WorkdirError(ValueError):
    """The workdir cannot be used as asked; the message names the problem and the choices."""


def as_plain(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as the JSON `config.json` holds (tuples become lists)."""
    return json.loads(config.to_json_best_effort())


def _get(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def step_dirs(workdir: str | os.PathLike) -> list[int]:
    """The checkpoint steps on disk (orbax names a finished step's folder by its number)."""
    folder = Path(workdir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def corrupt_steps(workdir: str | os.PathLike) -> list[str]:
    """The step folders a restore found unreadable and renamed to `<step>.corrupt-<time>`."""
    folder = Path(workdir) / CHECKPOINTS
    return sorted(p.name for p in folder.glob("*.corrupt-*")) if folder.is_dir() else []


@contextlib.contextmanager
def held(workdir: str | os.PathLike, *, enabled: bool = True) -> Iterator[None]:
    """Holds `<workdir>/train.lock` while a run trains there, so a second run in the same workdir
    is refused before it reads or moves anything (two runs would delete each other's saves in
    progress and interleave their logs). The lock is the kernel's (flock): it goes with the
    process however it ends, so a killed run never blocks its rerun. One process per job takes
    it (`enabled`: process 0); where the filesystem has no locks, a warning says so and the run
    goes on unguarded."""
    if not enabled:
        yield
        return
    workdir = Path(workdir)
    _not_a_file(workdir)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(workdir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise WorkdirError(f"cannot write to {workdir} ({e.strerror or e}); make it writable or "
                           f"pass another --workdir.") from e
    try:
        _lock(fd, workdir)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int, workdir: Path) -> None:
    """Takes the lock on `fd` and writes who holds it; raises `WorkdirError` naming the holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        raise WorkdirError(
            f"--workdir {workdir} is in use by another run ({holder}). Wait for it to end, stop "
            f"it (Ctrl-C or SIGTERM saves a checkpoint that a rerun here resumes from), or pass "
            f"another --workdir.") from None
    except OSError as e:  # e.g. a network filesystem without locks
        logging.getLogger("joyagents").warning(
            "cannot lock %s (%s): a second run started in this workdir would not be refused.",
            workdir / LOCK, e.strerror or e)
        return
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    holder = f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {' '.join(sys.argv)}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)


def check(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> None:
    """Raises `WorkdirError` unless `workdir` can hold this run; changes nothing on disk except
    a probe file written and removed in `checkpoints/` (and, with `config.restart`, the
    previous run's files moved into `restart-<time>/`)."""
    workdir = Path(workdir)
    _not_a_file(workdir)
    if config.restart:
        _restart(workdir)
    _probe(workdir / CHECKPOINTS)
    if step_dirs(workdir):
        _compatible(config, workdir)
    elif corrupt_steps(workdir):
        raise unreadable(workdir)


def _not_a_file(workdir: Path) -> None:
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirError(f"--workdir {workdir} is a file; pass a folder (it is created).")


def unreadable(workdir: str | os.PathLike) -> WorkdirError:
    return WorkdirError(
        f"{Path(workdir) / CHECKPOINTS} has no readable checkpoint (set aside: "
        f"{', '.join(corrupt_steps(workdir)) or 'none'}), so this run cannot resume. Start it again "
        f"from step 0 in this workdir with --config.restart=true (the old files move to "
        f"{Path(workdir) / 'restart-<time>'}), or pass a new --workdir.")


def _probe(folder: Path) -> None:
    """Writes and removes a file in `folder`, so a save cannot fail after a step's work."""
    probe = folder / f".write-probe-{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise WorkdirError(f"cannot write checkpoints to {folder} ({e.strerror or e}); make it "
                           f"writable or pass another --workdir.") from e


def _compatible(config: ml_collections.ConfigDict, workdir: Path) -> None:
    """The saved run's array-shaping keys must match; other changes are logged."""
    path = workdir / CONFIG
    if not path.exists():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WorkdirError(f"{path} is unreadable ({e}); restore it, or pass --config.restart="
                           f"true to start again from step 0, or a new --workdir.") from e
    now = as_plain(config)
    differ = [k for k in ARRAY_KEYS if _get(saved, k) != _get(now, k)]
    if differ:
        lines = "; ".join(f"config.{k}: saved {_get(saved, k)!r}, now {_get(now, k)!r}"
                          for k in differ)
        raise WorkdirError(f"{workdir} holds a run with other agents, models or memory shapes "
                           f"({lines}). Resume it with the settings saved in {path}, start again "
                           f"with --config.restart=true, or pass a new --workdir.")
    changed = sorted(_flat_diff(saved, now))
    if changed:
        logging.getLogger("joyagents").warning("Resuming %s with changed settings: %s", workdir,
                                               "; ".join(changed))


def _flat_diff(saved: Any, now: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for k in sorted(set(saved) | set(now)):
            out += _flat_diff(saved.get(k), now.get(k), f"{prefix}{k}.")
        return out
    return [] if saved == now else [f"{prefix[:-1]} {saved!r} -> {now!r}"]


def _restart(workdir: Path) -> None:
    """Moves the previous run's files into `restart-<time>/`: a fresh start loses nothing."""
    present = [name for name in RUN_FILES if (workdir / name).exists()]
    if not present:
        return
    target = workdir / f"restart-{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(parents=True)
    for name in present:
        os.replace(workdir / name, target / name)
    logging.getLogger("joyagents").warning("config.restart: moved %s into %s; starting from "
                                           "step 0.", ", ".join(present), target)


def finished(config: ml_collections.ConfigDict, workdir: str | os.PathLike
             ) -> dict[str, float] | None:
    """The final evaluation of a run that already reached its last step, else None."""
    path, steps = Path(workdir) / FINAL_EVAL, step_dirs(workdir)
    if config.restart or not path.exists() or not steps:
        return None
    if steps[-1] != config.sft.steps + config.grpo.steps:
        return None
    try:
        final = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return final or None


def write_config(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> None:
    """`config.json`, replaced atomically (a crash never leaves half a file)."""
    path = Path(workdir) / CONFIG
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(config.to_json_best_effort(indent=2))
    os.replace(tmp, path)
