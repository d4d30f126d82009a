"""Orbax checkpoints of a training run: the array state, JSON metadata, last N plus the best.

Each step is a folder `directory/<step>/` with three items:

- `state`: the array pytree (train state, memory tables, PRNG key), written with OCDBT;
- `metadata`: the caller's JSON (phase, phase step, data position, validation metric, config);
- `layout`: every array's path, dtype and shape and every static field's value, so a restore
  into the wrong config fails with a message instead of looking like a corrupt checkpoint.

Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it when complete, so a
save cut short by a crash or SIGKILL is never listed; leftovers are removed on the next open.

Restoring needs an abstract tree of the state, built from the config (for example
`jax.eval_shape` of the init, with `jax.ShapeDtypeStruct(..., sharding=...)` leaves, or a freshly
initialized state). Arrays come back bit for bit in that tree's shardings (cast where it asks
for another dtype, e.g. bfloat16 for evaluation; other shapes are an error); static
fields (model and optimizer configs of each `AgentGroup`) are not read from disk but taken from
the abstract tree, and `static_fields_check` reports where they differ from the saved run.

In a train loop (every process runs all of it; `save` is a collective):

    with Checkpointer(workdir / "checkpoints", best_metric="eval/test/accuracy") as ckpt, \
            preemption.Guard() as guard:
        step, state, meta = 0, init_state, {}
        if (restored := ckpt.restore_latest_valid(abstract)) is not None:
            (state, meta), step = restored, ckpt.latest_step()
        metrics_writer.truncate_after(step)     # drop log lines past the checkpoint
        for step in range(step + 1, total + 1):
            state = train_step(state)
            stop = guard.stop_agreed()
            if step % every == 0 or stop or step == total:
                ckpt.save(step, state, meta)    # returns once arrays are off the device
            if stop:
                break
    # leaving the `with` waits for the last write
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

STATE, METADATA, LAYOUT = "state", "metadata", "layout"
_REQUIRED = (f"{STATE}/manifest.ocdbt", f"{STATE}/_METADATA")  # OCDBT's index of the arrays


class CheckpointMismatchError(ValueError):
    """The abstract tree's arrays differ from the checkpoint's (another config or agent set)."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, permissions); the steps saved
    before it are whole."""


def _reason(error: Exception) -> str:
    """The OS's words for a failed write: tensorstore names the errno in its message."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    code = re.search(r"os_error_code='?(\d+)", str(error))
    return os.strerror(int(code.group(1))) if code else f"{type(error).__name__}: {error}"[:300]


# ----------------------------------------------------------------------------------------------
# Layout: what a restore must agree with.
# ----------------------------------------------------------------------------------------------


def array_layout(tree: Any) -> dict[str, list]:
    """Path -> [dtype, shape] of every array leaf (real arrays or ShapeDtypeStructs)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): [str(x.dtype), list(x.shape)] for path, x in leaves}


def static_fields(tree: Any, prefix: str = "") -> dict[str, str]:
    """Path -> repr of every static (`pytree_node=False`) dataclass field inside `tree`."""
    found = {}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for field in dataclasses.fields(tree):
            path, value = f"{prefix}.{field.name}", getattr(tree, field.name)
            if field.metadata.get("pytree_node", True):
                found.update(static_fields(value, path))
            else:
                found[path] = repr(value)
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            found.update(static_fields(value, f"{prefix}[{key!r}]"))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            found.update(static_fields(value, f"{prefix}[{i}]"))
    return found


def static_fields_check(abstract: Any, saved: Mapping[str, str]) -> list[str]:
    """Where the abstract tree's static fields differ from a checkpoint's saved `static_fields`.

    The restored state always carries the abstract tree's static fields (they live in the tree
    structure, not on disk). A difference is legitimate when intended (e.g. a longer schedule);
    otherwise the resumed run is not the saved one, so `Checkpointer.restore` logs each.
    """
    current = static_fields(abstract)
    return [f"{path}: saved {saved.get(path, '<absent>')}, now {current.get(path, '<absent>')}"
            for path in sorted(set(current) | set(saved)) if current.get(path) != saved.get(path)]


def _layout_check(abstract: Any, saved: Mapping[str, list], step: int) -> None:
    """Raises `CheckpointMismatchError` unless every saved array has a same-shaped target.

    A different dtype is a cast (e.g. float32 weights into a bfloat16 evaluation state) and is
    logged; PRNG keys can't be cast.
    """
    current = array_layout(abstract)
    problems, casts = [], []
    for path in sorted(set(current) | set(saved)):
        old, new = saved.get(path), current.get(path)
        if old == new:
            continue
        if old is None or new is None or old[1] != new[1] or "key<" in old[0] + new[0]:
            problems.append(f"{path}: saved {_describe(old)}, requested {_describe(new)}")
        else:
            casts.append(f"{path}: {old[0]} -> {new[0]}")
    if casts:
        logging.warning("Checkpoint step %d: %d arrays are cast to the requested dtype, e.g. %s",
                        step, len(casts), casts[0])
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointMismatchError(
            f"checkpoint step {step} holds other arrays than the requested state ({len(problems)} "
            f"differ):\n  {shown}{more}\nBuild the abstract state from the config the run was "
            f"saved with (same agents, model sizes and memory capacity), or use a fresh workdir.")


def _describe(entry: list | None) -> str:
    return "nothing" if entry is None else f"{entry[0]}{entry[1]}"


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """A restore target for one leaf: its shape, dtype and sharding (default: first device)."""
    sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _to_json(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """`metadata` with NumPy/JAX numbers as Python numbers; raises on anything else non-JSON."""
    def default(x: Any) -> Any:
        if isinstance(x, (np.ndarray, np.generic, jax.Array)):
            return np.asarray(x).tolist()
        raise TypeError(f"checkpoint metadata: a {type(x).__name__} is not JSON-serializable; "
                        f"pass numbers, strings, lists and dicts (e.g. config.to_dict()).")

    return json.loads(json.dumps(dict(metadata), default=default))


# ----------------------------------------------------------------------------------------------
# Checkpointer.
# ----------------------------------------------------------------------------------------------


def _cleaned(manager: ocp.CheckpointManager) -> ocp.CheckpointManager:
    """`manager` once its removal of unfinished `*.orbax-checkpoint-tmp*` steps is done.

    Newer orbax removes them in a background thread that neither `wait_until_finished` nor
    `close` joins, so a directory read right after `close` could still list them; older orbax
    removes them in the constructor and has no such thread.
    """
    await_cleanup = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
        await_cleanup()
    return manager


@contextlib.contextmanager
def _without_read_only_notice() -> Iterator[None]:
    """Drops orbax's warning that a read-only manager's directory is read only: we asked."""
    def notice(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")

    absl_log = logging.getLogger("absl")
    absl_log.addFilter(notice)
    try:
        yield
    finally:
        absl_log.removeFilter(notice)


class Checkpointer:
    """Saves and restores steps of a run in `directory`; every process calls every method.

    Keeps the `keep` most recent steps and, with `best_metric`, also the step whose
    `metadata[best_metric]` is highest (that value must be this step's validation metric; steps
    without it compete only for recency). With `async_save`, `save` returns once the arrays are
    copied off the device and the files are written in the background; `wait` blocks until done.

    With `read_only` (`joyagents eval`/`export`, beside a run that may still be training) nothing
    on disk changes: no removal of unfinished saves (a live run's save in progress), no deletion
    by the keep policy, an unreadable step is skipped rather than renamed, and `save` raises.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, best_metric: str | None = None,
                 async_save: bool = True, read_only: bool = False):
        if keep < 1:
            raise ValueError(f"Checkpointer: keep={keep} must be >= 1 (the latest step is the "
                             f"one a restart resumes from).")
        self.directory = Path(directory).absolute()
        self.best_metric = best_metric
        self._keep, self._async, self.read_only = keep, async_save, read_only
        self._manager = self._open()

    def _options(self, lightweight: bool = False) -> ocp.CheckpointManagerOptions:
        # max_to_keep with best_fn would keep the N best; "last N or the best" is an OR of policies.
        keep: list[policies.PreservationPolicy] = [policies.LatestN(n=self._keep)]
        best_fn = None
        if self.best_metric:
            best_fn = lambda metrics: metrics.get(self.best_metric, float("-inf"))  # noqa: E731
            keep.append(policies.BestN(get_metric_fn=best_fn, n=1,
                                       keep_checkpoints_without_metrics=False))
        if self.read_only:
            return ocp.CheckpointManagerOptions(
                read_only=True, save_interval_steps=0, create=False, best_fn=best_fn,
                best_mode="max", lightweight_initialize=lightweight)
        return ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep), best_fn=best_fn,
            best_mode="max", enable_async_checkpointing=self._async,
            cleanup_tmp_directories=True, lightweight_initialize=lightweight)

    def _open(self) -> ocp.CheckpointManager:
        """The manager; steps whose metadata can't be read are set aside with a warning."""
        try:
            return self._manager_of(self._options())
        except Exception as e:  # noqa: BLE001 - some step's metadata files are unreadable
            logging.warning("Checkpoints in %s: unreadable step metadata (%s); checking each step.",
                            self.directory, e)
        manager = self._manager_of(self._options(lightweight=True))
        for step in manager.all_steps():
            try:
                manager.item_metadata(step)
                manager.metrics(step)
            except Exception as e:  # noqa: BLE001
                self._set_aside(step, e)
        manager.reload()
        return manager

    def _manager_of(self, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
        with _without_read_only_notice():
            return _cleaned(ocp.CheckpointManager(self.directory, options=options))

    def _set_aside(self, step: int, error: Exception) -> None:
        """Renames an unreadable step to `<step>.corrupt-<time>`: hidden, but not deleted (read
        only: left as it is, with a warning)."""
        if self.read_only:
            logging.warning("Checkpoint step %d in %s is unreadable (%s: %s); skipped, left as it "
                            "is (read only).", step, self.directory, type(error).__name__,
                            str(error)[:500])
            return
        target = self.directory / f"{step}.corrupt-{int(time.time())}"
        logging.warning("Checkpoint step %d in %s is unreadable (%s: %s); moving it to %s and "
                        "falling back to the previous step.", step, self.directory,
                        type(error).__name__, str(error)[:500], target.name)
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")

    def save(self, step: int, state: Any, metadata: Mapping[str, Any], *,
             force: bool = False) -> bool:
        """Saves `state` (arrays) and `metadata` (JSON) as `step`; False if not saved.

        A step that already exists is not rewritten (e.g. the final save right after a periodic
        one). A step below the latest is saved only with `force`.
        """
        if self.read_only:
            raise ValueError(f"Checkpointer({self.directory}, read_only=True) cannot save.")
        if step in self._manager.all_steps():
            logging.info("Checkpoint step %d already exists in %s; not saved again.", step,
                         self.directory)
            return False
        metadata = _to_json(metadata)
        layout = {"arrays": array_layout(state), "static": static_fields(state)}
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                     METADATA: ocp.args.JsonSave(metadata),
                                     LAYOUT: ocp.args.JsonSave(layout)})
        with self._writing():  # also raises the previous asynchronous save's failure
            return self._manager.save(step, args=args, force=force,
                                      metrics=self._metrics(metadata))

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Turns a failed write into a `SaveError` naming the cause and the last whole step."""
        try:
            yield
        except SaveError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types
            try:
                whole = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]
            except OSError:  # the folder itself is what failed
                whole = []
            raise SaveError(
                f"writing a checkpoint to {self.directory} failed ({_reason(e)}). The steps "
                f"saved before are whole (latest: {max(whole, default='none')}); rerun the same "
                f"command once the cause is fixed (a full disk: make room, or keep fewer steps "
                f"with --config.checkpoint.keep) and it resumes from there.") from e

    def _metrics(self, metadata: Mapping[str, Any]) -> dict[str, float] | None:
        """The ranking metric for orbax; a step without it ranks below every step with it."""
        if not self.best_metric:
            return None
        value = metadata.get(self.best_metric)
        return {self.best_metric: float("-inf") if value is None else float(value)}

    def wait(self) -> None:
        """Blocks until the pending asynchronous save is on disk (a failure: `SaveError`)."""
        with self._writing():
            self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the highest `best_metric` (the latest without one)."""
        return self._manager.best_step()

    def _json_items(self, step: int | None) -> tuple[int, dict[str, Any]]:
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory} "
                                    f"(steps: {self.all_steps()})")
        return step, self._manager.restore(step, args=ocp.args.Composite(
            **{METADATA: ocp.args.JsonRestore(), LAYOUT: ocp.args.JsonRestore()}))

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of `step` (default: the latest), without reading any array."""
        return self._json_items(step)[1][METADATA]

    def latest_metadata(self) -> dict[str, Any]:
        return self.metadata()

    def restore(self, abstract: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """(state, metadata) of `step` (default: the latest), shaped like `abstract`.

        `abstract` is a pytree of `jax.ShapeDtypeStruct`s (with shardings) or of real arrays;
        leaves without a sharding go to the first device. It may also be a function of the
        step's metadata returning that pytree, when the state's shape depends on it (e.g. the
        phase). Raises `CheckpointMismatchError` if the arrays differ from the saved ones in
        shape, the tree in structure, or building `abstract` fails (none of which is a corrupt
        checkpoint), FileNotFoundError if there is no such step.
        """
        step, items = self._json_items(step)
        missing = [name for name in _REQUIRED if not (self.directory / str(step) / name).exists()]
        if missing:  # checked here: tensorstore's own failure floods stderr (see _quiet_stderr)
            raise FileNotFoundError(f"checkpoint step {step} lacks {', '.join(missing)}")
        metadata = items[METADATA]
        if callable(abstract):
            try:
                abstract = abstract(metadata)
            except Exception as e:  # the caller's code or config, not the checkpoint
                raise CheckpointMismatchError(f"building the state to restore checkpoint step "
                                              f"{step} into failed: {e!r}") from e
        _layout_check(abstract, items[LAYOUT]["arrays"], step)
        for diff in static_fields_check(abstract, items[LAYOUT]["static"]):
            logging.warning("Checkpoint step %d: static field differs, using the current value: "
                            "%s", step, diff)
        target = jax.tree.map(_abstract, abstract)
        try:
            arrays = self._manager.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(target)}))
        except ValueError as e:
            if "tree structures do not match" not in str(e):
                raise
            raise CheckpointMismatchError(  # same arrays (checked above), other pytree nodes
                f"checkpoint step {step} was saved from a state of another structure than this "
                f"version of the code builds: {e}") from e
        return arrays[STATE], metadata

    def restore_latest_valid(self, abstract: Any) -> tuple[Any, dict[str, Any]] | None:
        """(state, metadata) of the newest readable step; None if there are no steps.

        An unreadable step is moved aside with a warning naming it and the previous one is
        tried, so afterwards `latest_step()` is the restored step (read only: skipped, and still
        listed). `abstract` is as in `restore`; pass a function of the metadata when the state's
        shape depends on the step (a fallback may cross the SFT -> GRPO boundary). A
        `CheckpointMismatchError` (wrong config) is raised, never treated as corruption. Raises
        RuntimeError if steps exist but none is readable. The tracebacks tensorstore's late
        callbacks print after a failed read ("Event loop is closed") are held back and counted in
        one warning.
        """
        tried = self.all_steps()
        with _quiet_stderr() as noise:
            for step in reversed(tried):
                try:
                    return self.restore(abstract, step)
                except CheckpointMismatchError:
                    raise
                except Exception as e:  # noqa: BLE001 - any read failure: the step is unusable
                    self._set_aside(step, e)
                    self._manager.reload()
                    noise.failed = True
        if tried:
            aside = "left in place" if self.read_only else "renamed to <step>.corrupt-*"
            raise RuntimeError(f"no readable checkpoint in {self.directory}: steps {tried} were "
                               f"all unreadable ({aside}).")
        return None

    def restore_newest(self, abstract: Any, tries: int = 5) -> tuple[Any, dict[str, Any]]:
        """`restore` of the newest step on disk now. Where a run still training in this
        directory deletes that step while it is read (its keep policy), the then newest is read
        instead, up to `tries` steps. `abstract` is as in `restore`."""
        with _quiet_stderr() as noise:
            for _ in range(tries):
                self._manager.reload()
                step = self.latest_step()
                if step is None:
                    raise FileNotFoundError(f"no checkpoint in {self.directory}")
                try:
                    return self.restore(abstract, step)
                except CheckpointMismatchError:
                    raise
                except Exception:  # noqa: BLE001 - a read failure: gone, or unreadable
                    self._manager.reload()
                    if step in self._manager.all_steps():
                        raise
                    noise.failed = True
                    logging.info("Checkpoint step %d in %s was deleted while it was read; "
                                 "reading the newest step now.", step, self.directory)
        raise RuntimeError(f"{tries} newest checkpoints in {self.directory} were each deleted "
                           f"while they were read: the run there saves faster than they can be "
                           f"read. Name a step it keeps, or read once it has ended.")

    def close(self) -> None:
        """Waits for the pending save and releases the manager; call before the process exits."""
        with self._writing():
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Noise:
    failed = False


def save_tree(path: str | Path, tree: Any) -> None:
    """Writes one array pytree to `path` (replacing it; orbax renames a complete write into
    place, so a crash leaves the previous tree or none). A collective across processes."""
    with ocp.StandardCheckpointer() as saver:
        saver.save(Path(path).absolute(), tree, force=True)


def restore_tree(path: str | Path, abstract: Any) -> Any:
    """The tree `save_tree` wrote, shaped (and sharded) like `abstract`."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing: it holds the LoRA base the checkpoints' "
                                f"adapters belong to; restore it, or train again with "
                                f"--config.restart=True.")
    with ocp.StandardCheckpointer() as loader:
        return loader.restore(path, jax.tree.map(_abstract, abstract))


@contextlib.contextmanager
def _quiet_stderr():
    """Captures file descriptor 2 (C++ threads write there too); afterwards replays every line
    except the asyncio tracebacks of reads cut short, and warns once how many were dropped."""
    sys.stderr.flush()
    saved, noise = os.dup(2), _Noise()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield noise
        finally:
            if noise.failed:  # let the cut-short reads report now, while stderr is held
                time.sleep(0.5)
                gc.collect()
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines()
    kept = [ln for ln in lines if not _is_loop_noise(ln)]
    if kept:
        print("\n".join(kept), file=sys.stderr)
    if len(kept) < len(lines):
        logging.warning("Held back %d lines of tensorstore tracebacks ('Event loop is closed') "
                        "from the unreadable checkpoint reads.", len(lines) - len(kept))


_LOOP_NOISE = re.compile(r"Event loop is closed|_check_closed|call_soon_threadsafe|"
                         r"Task exception was never retrieved|^future: <Task|NOT_FOUND|"
                         r"Traceback \(most recent call last\)|^\W*RuntimeError\W*$|^[\s^~:]*$")


def _is_loop_noise(line: str) -> bool:
    """A piece of those tracebacks (several threads interleave them mid-line)."""
    return line.startswith((" ", "\t")) or bool(_LOOP_NOISE.search(line))
