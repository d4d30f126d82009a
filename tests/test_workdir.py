"""The workdir checks that run before any work: one run at a time, writable, compatible,
finished, restart."""

import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from joyagents_jax import config as config_lib
from joyagents_jax import train, workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _saved_run(path, config=None, steps=(3,), final=None):
    """A workdir as a run leaves it: config.json, step folders, maybe final_eval.json."""
    config = config or config_lib.get_config()
    path.mkdir(parents=True, exist_ok=True)
    workdir.write_config(config, path)
    for step in steps:
        (path / "checkpoints" / str(step)).mkdir(parents=True)
    if final is not None:
        (path / "final_eval.json").write_text(json.dumps(final))
    return path


def _files(path):
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
            for p in sorted(path.rglob("*"))}


def test_a_new_workdir_passes_and_only_gets_its_checkpoint_folder(tmp_path):
    workdir.check(config_lib.get_config(), tmp_path / "new")
    assert _files(tmp_path / "new") == {"checkpoints": None}


def test_an_unwritable_checkpoint_folder_is_refused_before_any_work(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "checkpoints").write_text("a file where the folder should be")
    with pytest.raises(workdir.WorkdirError, match="cannot write checkpoints to .*checkpoints"):
        workdir.check(config_lib.get_config(), tmp_path / "w")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_checkpoint_folder_is_refused(tmp_path):
    (tmp_path / "w" / "checkpoints").mkdir(parents=True)
    os.chmod(tmp_path / "w" / "checkpoints", 0o555)
    try:
        with pytest.raises(workdir.WorkdirError, match="make it writable"):
            workdir.check(config_lib.get_config(), tmp_path / "w")
    finally:
        os.chmod(tmp_path / "w" / "checkpoints", 0o755)


def test_resuming_with_other_array_shapes_is_refused_and_changes_nothing(tmp_path):
    run = _saved_run(tmp_path / "w")
    before = _files(run)
    c = config_lib.get_config()
    c.groups.all.model = "small-30m"
    with pytest.raises(workdir.WorkdirError, match=r"config.groups: saved .*tiny.*small-30m"):
        workdir.check(c, run)
    assert _files(run) == before


def test_other_settings_resume_with_a_warning(tmp_path, caplog):
    run = _saved_run(tmp_path / "w")
    c = config_lib.get_config()
    c.grpo.steps = 90
    with caplog.at_level(logging.WARNING):
        workdir.check(c, run)
    assert "grpo.steps 44 -> 90" in caplog.text


def test_only_unreadable_checkpoints_are_refused_until_restart(tmp_path):
    run = _saved_run(tmp_path / "w", steps=())
    (run / "checkpoints" / "3.corrupt-17").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / workdir.HANGUP_LOG).write_text("Preempted at step 1\n")
    c = config_lib.get_config()
    with pytest.raises(workdir.WorkdirError, match=r"3.corrupt-17.*--config.restart=true"):
        workdir.check(c, run)
    c.restart = True
    workdir.check(c, run)
    moved = list(run.glob("restart-*"))
    assert len(moved) == 1
    assert (moved[0] / "checkpoints" / "3.corrupt-17").is_dir()
    assert (moved[0] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (moved[0] / workdir.HANGUP_LOG).read_text() == "Preempted at step 1\n"
    assert not (run / "metrics.jsonl").exists() and (run / "checkpoints").is_dir()
    assert not (run / workdir.HANGUP_LOG).exists()


def test_finished_needs_the_final_evaluation_at_the_last_step(tmp_path):
    c = config_lib.get_config()
    total = c.sft.steps + c.grpo.steps
    final = {"eval/test/accuracy": 0.5}
    assert workdir.finished(c, _saved_run(tmp_path / "a", steps=(total,), final=final)) == final
    assert workdir.finished(c, _saved_run(tmp_path / "b", steps=(total - 1,), final=final)) is None
    assert workdir.finished(c, _saved_run(tmp_path / "c", steps=(total,))) is None
    assert workdir.finished(c, _saved_run(tmp_path / "d", steps=(total,), final={})) is None
    c.grpo.steps += 10  # the same workdir, trained longer: not finished
    assert workdir.finished(c, tmp_path / "a") is None


def test_a_held_workdir_refuses_a_second_run_naming_the_first(tmp_path):
    with workdir.held(tmp_path / "w"):
        holder = (tmp_path / "w" / workdir.LOCK).read_text()
        assert holder.startswith(f"pid {os.getpid()} on ")
        with pytest.raises(workdir.WorkdirError, match=rf"in use by another run \(pid "
                                                        rf"{os.getpid()} on .*another --workdir"):
            with workdir.held(tmp_path / "w"):
                pass
    with workdir.held(tmp_path / "w"):  # released on leaving
        pass


def test_the_lock_goes_with_a_killed_holder(tmp_path):
    code = ("import sys, time; from joyagents_jax import workdir\n"
            f"with workdir.held({str(tmp_path)!r}):\n print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(workdir.WorkdirError, match=f"pid {proc.pid} "):
            with workdir.held(tmp_path):
                pass
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with workdir.held(tmp_path):  # no stale lock: the kernel released it with the process
        pass


def test_only_the_enabled_process_takes_the_lock(tmp_path):
    with workdir.held(tmp_path / "w", enabled=False), workdir.held(tmp_path / "w", enabled=False):
        assert not (tmp_path / "w").exists()


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING), workdir.held(tmp_path / "w"):
        assert "would not be refused" in caplog.text and "No locks available" in caplog.text


def test_a_file_as_workdir_is_refused_before_locking(tmp_path):
    (tmp_path / "w").write_text("not a folder")
    with pytest.raises(workdir.WorkdirError, match="is a file"):
        with workdir.held(tmp_path / "w"):
            pass


def test_train_refuses_a_workdir_in_use_and_moves_nothing(tmp_path, capsys):
    run = _saved_run(tmp_path / "w")
    before = _files(run)
    with workdir.held(run):
        rc = train.main([f"--workdir={run}", "--config.restart=true"])
    assert rc == 2
    assert "is in use by another run" in capsys.readouterr().err
    assert {k: v for k, v in _files(run).items() if k != workdir.LOCK} == before
