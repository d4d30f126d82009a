"""Tests for joyagents_jax.checkpoint: exact round trips, retention, corruption, preemption."""

import logging
import os
import shutil
import signal
import subprocess
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from joyagents_jax import checkpoint, xla_flags
from joyagents_jax import train_state as ts
from joyagents_jax.models import qwen2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUB = qwen2.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2)
OPTIM = ts.OptimConfig(learning_rate=1e-2, schedule="constant", weight_decay=0.1)


@flax.struct.dataclass
class Memory:
    """Stands in for a memory table: arrays plus a static capacity."""

    keys: jax.Array  # [N, D] bfloat16
    hits: jax.Array  # [N] int32
    capacity: int = flax.struct.field(pytree_node=False)


def _state(seed: int = 0) -> dict:
    """A TrainState after one real optimizer step (non-trivial Adam moments), plus memory."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    params = {"embed": normal(3, 5, 4), "dense": {"kernel": normal(3, 4, 2), "bias": normal(3, 2)}}
    group = ts.init_group(SUB, OPTIM, params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
    group = ts.apply_gradients(group, grads, jnp.array([True, False, True]))
    memory = Memory(keys=jnp.asarray(rng.standard_normal((6, 4)), jnp.bfloat16),
                    hits=jnp.arange(6, dtype=jnp.int32), capacity=6)
    return {"train": ts.create({"subs": group}), "memory": memory}


def _bits(tree) -> list[bytes]:
    """Every leaf's dtype, shape and raw bytes (PRNG keys by their key data)."""
    def raw(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        x = np.asarray(x)
        return str(x.dtype).encode() + str(x.shape).encode() + x.tobytes()

    return [raw(x) for x in jax.tree.leaves(tree)]


def _corrupt(path, only_arrays: bool) -> None:
    """Overwrites the files of a step folder (the array data only, or everything)."""
    for f in path.rglob("*"):
        if f.is_file() and (not only_arrays or f"{os.sep}state{os.sep}" in str(f)):
            f.write_bytes(b"not a checkpoint")


def test_round_trip_is_bitwise_and_safe_against_donation(tmp_path):
    state = _state()
    want = _bits(state)
    meta = {"phase": "grpo", "phase_step": 3, "data": {"epoch": 1, "index": 17},
            "val/accuracy": np.float32(0.5), "config": {"agents": ["master", "math"]}}
    with checkpoint.Checkpointer(tmp_path, async_save=True) as ckpt:
        assert ckpt.save(3, state, meta)
        # The next train step donates the state and overwrites it while the write is in flight.
        bump = lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.number) else x
        jax.jit(lambda s: jax.tree.map(bump, s), donate_argnums=0)(state)
        ckpt.wait()
        abstract = jax.eval_shape(_state)
        restored, got_meta = ckpt.restore(abstract)
        assert _bits(restored) == want
        assert got_meta == {**meta, "val/accuracy": 0.5}
        assert restored["train"].groups["subs"].model == SUB  # static fields from the abstract
        assert restored["memory"].capacity == 6
        example, _ = ckpt.restore(_state(seed=1), step=3)  # real arrays work as the target too
        assert _bits(example) == want
        assert not ckpt.save(3, _state(), meta)  # an existing step is not rewritten


def test_keeps_last_n_and_the_best(tmp_path):
    state = {"w": jnp.zeros(3)}
    val = {1: 0.1, 2: 0.9, 3: None, 4: 0.2, 5: 0.3, 6: None}
    with checkpoint.Checkpointer(tmp_path, keep=2, best_metric="val", async_save=False) as ckpt:
        for step, v in val.items():
            ckpt.save(step, state, {"val": v})
        assert ckpt.all_steps() == [2, 5, 6]
        assert ckpt.best_step() == 2
    with checkpoint.Checkpointer(tmp_path, keep=2, best_metric="val", async_save=False) as ckpt:
        ckpt.save(7, state, {"val": None})  # the best survives a restart (metrics on disk)
        assert ckpt.all_steps() == [2, 6, 7]
        ckpt.save(8, state, {"val": 0.95})
        assert ckpt.all_steps() == [7, 8]


def test_a_missing_manifest_falls_back_with_one_warning_not_tracebacks(tmp_path, capfd):
    tree = {f"w{i}": jnp.full((64, 8), i, jnp.float32) for i in range(40)}
    with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, jax.tree.map(lambda x: x + step, tree), {"step": step})
    (tmp_path / "2" / "state" / "manifest.ocdbt").unlink()
    capfd.readouterr()
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        state, meta = ckpt.restore_latest_valid(tree)
    err = capfd.readouterr().err
    assert meta == {"step": 1}
    np.testing.assert_array_equal(state["w3"], np.full((64, 8), 4.0))
    assert "Event loop is closed" not in err and "Traceback" not in err
    assert len(err.splitlines()) <= 3, err


@pytest.mark.parametrize("only_arrays", [True, False], ids=["arrays", "all_files"])
def test_corrupted_latest_falls_back_with_a_warning(tmp_path, caplog, only_arrays):
    with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jnp.full(4, step, jnp.float32)}, {"step": step})
    _corrupt(tmp_path / "3", only_arrays)
    with caplog.at_level(logging.WARNING), checkpoint.Checkpointer(tmp_path) as ckpt:
        state, meta = ckpt.restore_latest_valid({"w": jnp.zeros(4, jnp.float32)})
        assert (ckpt.latest_step(), meta) == (2, {"step": 2})
        np.testing.assert_array_equal(state["w"], np.full(4, 2.0))
        assert any("step 3" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING)
        assert ckpt.all_steps() == [1, 2]
        assert len(list(tmp_path.glob("3.corrupt-*"))) == 1  # set aside, not deleted
        assert ckpt.save(3, state, {"step": 3})  # training goes on from the fallback
        ckpt.wait()


def test_fallback_across_phases_builds_the_target_from_metadata(tmp_path):
    by_phase = {"sft": {"w": jnp.ones(2)}, "grpo": {"w": jnp.ones(2), "memory": jnp.ones(5)}}
    with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, by_phase["sft"], {"phase": "sft"})
        ckpt.save(2, by_phase["grpo"], {"phase": "grpo"})
        assert ckpt.metadata() == {"phase": "grpo"} and ckpt.metadata(1) == {"phase": "sft"}
    _corrupt(tmp_path / "2", only_arrays=True)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        state, meta = ckpt.restore_latest_valid(lambda meta: by_phase[meta["phase"]])
    assert meta == {"phase": "sft"} and set(state) == {"w"}


def test_config_mismatch_is_an_error_not_corruption(tmp_path, caplog):
    with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, _state(), {})
        bigger = jax.eval_shape(_state)
        bigger["train"].groups["subs"].params["embed"] = jax.ShapeDtypeStruct((3, 6, 4),
                                                                              jnp.float32)
        with pytest.raises(checkpoint.CheckpointMismatchError, match=r"\['embed'\]"):
            ckpt.restore_latest_valid(bigger)
        assert ckpt.all_steps() == [1]  # not set aside
        other = jax.eval_shape(_state)
        group = other["train"].groups["subs"]
        other["train"].groups["subs"] = group.replace(optim=ts.OptimConfig(learning_rate=1.0))
        with caplog.at_level(logging.WARNING):
            restored, _ = ckpt.restore(other)
        assert restored["train"].groups["subs"].optim.learning_rate == 1.0
        assert any("learning_rate=1.0" in r.getMessage() for r in caplog.records)
        evaluation = jax.eval_shape(_state)  # a dtype change is a cast, not a mismatch
        evaluation["train"].groups["subs"].params["embed"] = jax.ShapeDtypeStruct((3, 5, 4),
                                                                                  jnp.bfloat16)
        cast, _ = ckpt.restore(evaluation)
        want = _state()["train"].groups["subs"].params["embed"].astype(jnp.bfloat16)
        assert _bits(cast["train"].groups["subs"].params["embed"]) == _bits(want)


def test_a_state_of_another_structure_or_a_failing_target_is_not_corruption(tmp_path):
    """Neither a target with a node the saved tree lacks (the same arrays) nor a target
    function that raises sets a good checkpoint aside."""
    with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, {"w": jnp.ones(2)}, {"phase": "sft"})
        with pytest.raises(checkpoint.CheckpointMismatchError, match="another structure"):
            ckpt.restore_latest_valid({"w": jnp.ones(2), "extra": None})
        with pytest.raises(checkpoint.CheckpointMismatchError, match="KeyError"):
            ckpt.restore_latest_valid(lambda meta: {"w": jnp.ones(2)}[meta["missing"]])
        assert ckpt.all_steps() == [1]
        restored, _ = ckpt.restore_latest_valid({"w": jnp.zeros(2)})
    np.testing.assert_array_equal(restored["w"], np.ones(2))


def test_empty_directory_restores_nothing(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "new") as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.restore_latest_valid({"w": jnp.zeros(2)}) is None


def test_a_reader_beside_a_live_run_changes_nothing(tmp_path, caplog):
    with checkpoint.Checkpointer(tmp_path, keep=3, async_save=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jnp.full(4, step, jnp.float32)}, {"step": step})
    _corrupt(tmp_path / "3", only_arrays=True)
    (tmp_path / "4.orbax-checkpoint-tmp").mkdir()  # a live run's save in progress
    before = sorted(p.name for p in tmp_path.iterdir())
    with caplog.at_level(logging.WARNING), \
            checkpoint.Checkpointer(tmp_path, keep=1, read_only=True) as reader:
        state, meta = reader.restore_latest_valid({"w": jnp.zeros(4, jnp.float32)})
        assert meta == {"step": 2}  # step 3 skipped, not renamed
        with pytest.raises(ValueError, match="read_only=True.*cannot save"):
            reader.save(5, state, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert "step 3" in caplog.text and "read only" in caplog.text
    assert "Given directory is read only" not in caplog.text  # orbax's notice, asked for
    with checkpoint.Checkpointer(tmp_path):  # a writer opening here removes that save
        assert not (tmp_path / "4.orbax-checkpoint-tmp").exists()


def test_restore_newest_reads_on_when_a_live_run_deletes_the_step_it_reads(tmp_path, monkeypatch):
    with checkpoint.Checkpointer(tmp_path, keep=5, async_save=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jnp.full(4, step, jnp.float32)}, {"step": step})
    reader = checkpoint.Checkpointer(tmp_path, read_only=True)
    restore, read = reader.restore, []

    def deleted_while_read(abstract, step):  # the writer's keep policy, mid-read
        read.append(step)
        if step == 3:
            shutil.rmtree(tmp_path / "3")
        return restore(abstract, step)

    monkeypatch.setattr(reader, "restore", deleted_while_read)
    state, meta = reader.restore_newest({"w": jnp.zeros(4, jnp.float32)})
    assert (read, meta) == ([3, 2], {"step": 2})
    np.testing.assert_array_equal(state["w"], np.full(4, 2.0))
    _corrupt(tmp_path / "2", only_arrays=True)  # unreadable but still there: its error
    with pytest.raises(ValueError, match="Expecting value"):  # the array index's JSON
        reader.restore_newest({"w": jnp.zeros(4, jnp.float32)})


def test_restore_newest_gives_up_after_tries_steps_deleted_while_read(tmp_path, monkeypatch):
    with checkpoint.Checkpointer(tmp_path, keep=5, async_save=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jnp.full(4, step, jnp.float32)}, {"step": step})
    reader = checkpoint.Checkpointer(tmp_path, read_only=True)
    restore = reader.restore

    def deleted_while_read(abstract, step):
        shutil.rmtree(tmp_path / str(step))
        return restore(abstract, step)

    monkeypatch.setattr(reader, "restore", deleted_while_read)
    with pytest.raises(RuntimeError, match="2 newest checkpoints .* each deleted while"):
        reader.restore_newest({"w": jnp.zeros(4, jnp.float32)}, tries=2)
    assert reader.all_steps() == [1]


def test_a_failed_write_is_a_save_error_naming_the_cause_and_the_last_whole_step(tmp_path,
                                                                                monkeypatch):
    full = ValueError("RESOURCE_EXHAUSTED: Error writing \"w/0.0\" in OCDBT database: Failed to "
                      "write 356058 bytes to file 12: No space left on device "
                      "[os_error_code='28']")  # tensorstore's words, from a full tmpfs

    def fails(*args, **kwargs):
        raise full

    with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, {"w": jnp.ones(4)}, {"step": 1})
        monkeypatch.setattr(ckpt._manager, "save", fails)
        with pytest.raises(checkpoint.SaveError, match=r"failed \(No space left on device\)\. "
                                                       r"The steps saved before are whole "
                                                       r"\(latest: 1\)") as error:
            ckpt.save(2, {"w": jnp.ones(4)}, {"step": 2})
        assert error.value.__cause__ is full
        def over_quota():
            raise OSError(122, "Disk quota exceeded")

        monkeypatch.setattr(ckpt._manager, "wait_until_finished", over_quota)
        with pytest.raises(checkpoint.SaveError, match=r"\(Disk quota exceeded\)"):
            ckpt.wait()
        monkeypatch.undo()
    assert ckpt.all_steps() == [1]


def _run(code: str, devices: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    xla_flags.enough_cpu_threads(env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def save_then_die_before_commit(directory: str) -> None:
    """Subprocess: step 1 completes; step 2 is killed (SIGKILL) with every file written but
    before orbax's commit rename, the last moment a crash can hit a save."""
    from orbax.checkpoint._src.path import atomicity

    async def killed(self):
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt = checkpoint.Checkpointer(directory)
    ckpt.save(1, {"w": jnp.ones(8)}, {"step": 1})
    ckpt.wait()
    atomicity.AtomicRenameTemporaryPath.finalize = killed
    ckpt.save(2, {"w": jnp.full(8, 2.0)}, {"step": 2})
    ckpt.wait()


def test_interrupted_save_is_never_visible(tmp_path):
    proc = _run(f"from tests.test_checkpoint import save_then_die_before_commit as f; "
                f"f({str(tmp_path)!r})")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())  # half-written
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        assert ckpt.restore_latest_valid({"w": jnp.zeros(8)})[1] == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # leftovers cleaned on open


def reshard_round_trip(directory: str) -> None:
    """Subprocess on 4 devices: save replicated, restore sharded over a mesh, bit for bit."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    state = _state()
    with checkpoint.Checkpointer(directory) as ckpt:
        ckpt.save(1, state, {})
        ckpt.wait()
        spec = lambda x: P(None, "fsdp") if x.ndim == 2 and x.shape[1] % 4 == 0 else P()
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))),
            state)
        restored, _ = ckpt.restore(target)
    assert _bits(restored) == _bits(state)
    keys = restored["memory"].keys
    assert keys.sharding == NamedSharding(mesh, P(None, "fsdp"))
    assert keys.addressable_shards[0].data.shape == (6, 1)
    print("resharded ok")


def test_restore_into_other_shardings(tmp_path):
    proc = _run(f"from tests.test_checkpoint import reshard_round_trip as f; "
                f"f({str(tmp_path)!r})", devices=4)
    assert proc.returncode == 0 and "resharded ok" in proc.stdout, proc.stderr[-3000:]
