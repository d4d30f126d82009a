"""Shared test fixtures. Tests run on the CPU in float32 with deterministic seeds."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per session, inherited by the tests' subprocesses: the
# multi-process job's rerun, the fresh-process determinism checks and the many tests that
# build the same tiny programs load an executable instead of compiling it again. A loaded
# executable is the compiled one, so no result changes; set JAX_COMPILATION_CACHE_DIR to keep
# one across sessions, or to "" to compile everything.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="joyagents_tests_xla_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Tests compile at XLA's backend optimization level 0: the same HLO programs (what this code
# builds), lowered by LLVM without its optimizations. Most tests compile more than they run; on
# 2 cores pytest took 9:49 instead of 14:12 (benchmarks/RESULTS.md, "The test suite at backend
# optimization level 0"). The README runs, the learning study and tests/test_learning.py use
# XLA's default; a level already in XLA_FLAGS is kept.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        "--xla_backend_optimization_level=0"]).strip()

from joyagents_jax import xla_flags  # noqa: E402

xla_flags.pin_cpu_numerics()  # as the `joyagents` command does: in-process runs match its own

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def qwen25_tokenizer_dir(tmp_path_factory) -> str:
    """A Qwen2.5 tokenizer folder, built offline once per session (a few seconds)."""
    from joyagents_jax.tokenizers import build_qwen25_tokenizer

    return str(build_qwen25_tokenizer(tmp_path_factory.mktemp("qwen25_tokenizer")))


@pytest.fixture
def spawn_on_a_terminal():
    """spawn(argv, env) starts argv as the leader of a new session whose controlling terminal
    is a fresh pty, as a login over ssh runs a command, and returns (pid, master fd): closing
    the master hangs the terminal up. posix_spawn, not fork: the test process runs JAX's
    threads."""
    def spawn(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
        master, slave = os.openpty()
        try:
            pid = os.posix_spawn(argv[0], argv, env, setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.ttyname(slave), os.O_RDWR, 0),
                (os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2)])
        finally:
            os.close(slave)
        return pid, master

    return spawn
