"""XLA CPU flags that narrow how much a run's numbers depend on the x86-64 CPU that runs it.

Measured on this project's machines (benchmarks/RESULTS.md, "Reproducibility"): XLA's CPU
backend sends matmuls to YNNPACK fusions, which pick their kernels by the CPU's features at run
time, and compiles the rest for the host's widest vector ISA; both change the last bits of
float results, and hundreds of training steps amplify those bits into different accuracies.
These flags turn YNNPACK off and cap the ISA at AVX2, at no measured cost in speed on the
default. They do not make a seed CPU-independent: an AVX-512 Intel host and an AVX2-only AMD
host still part during SFT (which kernel still differs is open). Set
`JOYAGENTS_PORTABLE_CPU_NUMERICS=0` to keep XLA's defaults. Imports nothing from JAX: call
`pin_cpu_numerics()` before JAX starts its backend."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

PORTABLE = ("--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_max_isa=AVX2")
SWITCH = "JOYAGENTS_PORTABLE_CPU_NUMERICS"


def pin_cpu_numerics(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds the `PORTABLE` flags to XLA_FLAGS, except those the user already set."""
    if environ.get(SWITCH, "1") == "0":
        return
    flags = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in flags}
    flags += [f for f in PORTABLE if f.split("=", 1)[0] not in names]
    environ["XLA_FLAGS"] = " ".join(flags)
