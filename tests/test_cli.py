"""`joyagents SUBCOMMAND --help` answers with its usage and exits 0, for every subcommand; the
command keeps what it compiles in the user's cache folder."""

import os
import subprocess
import sys

import pytest

from joyagents_jax import cli


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_subcommand_answers_help(name, capsys):
    try:
        status = cli.main([name, "--help"])
    except SystemExit as e:  # argparse exits after printing help
        status = e.code
    assert status == 0
    assert capsys.readouterr().out.startswith(f"usage: joyagents {name}")


def test_unknown_subcommand_is_named(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown subcommand 'trian'" in capsys.readouterr().err


def test_a_second_command_loads_what_the_first_compiled(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path), JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # the check's programs are tiny
    command = [sys.executable, "-m", "joyagents_jax.cli", "check-cluster", "--cluster", "none"]
    runs = [subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert os.listdir(tmp_path / "joyagents" / "xla")
    assert "Persistent compilation cache hit" not in runs[0].stderr
    assert "Persistent compilation cache hit for 'jit_score'" in runs[1].stderr
