"""`joyagents SUBCOMMAND --help` answers with its usage and exits 0, for every subcommand."""

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
