"""The workdir checks that run before any work: writable, compatible, finished, restart."""

import json
import logging
import os

import pytest

from joyagents_jax import config as config_lib
from joyagents_jax import workdir


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
    c = config_lib.get_config()
    with pytest.raises(workdir.WorkdirError, match=r"3.corrupt-17.*--config.restart=true"):
        workdir.check(c, run)
    c.restart = True
    workdir.check(c, run)
    moved = list(run.glob("restart-*"))
    assert len(moved) == 1
    assert (moved[0] / "checkpoints" / "3.corrupt-17").is_dir()
    assert (moved[0] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (run / "metrics.jsonl").exists() and (run / "checkpoints").is_dir()


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
