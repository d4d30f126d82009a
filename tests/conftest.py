"""Shared test fixtures. Tests run on the CPU in float32 with deterministic seeds."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
