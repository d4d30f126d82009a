"""Shared test fixtures. Tests run on the CPU in float32 with deterministic seeds."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
