"""The embedded default (tiny byte-level agents on the assistant suite), with ablation args.

    joyagents train --config experiments/configs/assistant_tiny.py --workdir runs/tiny
    joyagents train --config experiments/configs/assistant_tiny.py:mode=trajectory,topk=0,memory=off

Args (comma-separated key=value): mode (nodewise | trajectory | full_tree), topk (0 = all
groups), select (groups | agents), memory (on | off), seed, sft_only (true: no GRPO steps).
"""

from joyagents_jax import config as config_lib


def get_config(arg: str = ""):
    c = config_lib.get_config()
    for item in filter(None, arg.split(",")):
        key, _, value = item.partition("=")
        if key == "mode":
            c.grpo.mode = value
        elif key == "topk":
            c.grpo.topk = int(value)
        elif key == "select":
            c.grpo.select = value
        elif key == "memory":
            c.memory.enabled = value == "on"
        elif key == "seed":
            c.seed = int(value)
        elif key == "sft_only":
            c.grpo.steps = 0 if value == "true" else c.grpo.steps
        else:
            raise ValueError(f"assistant_tiny.py: unknown arg {key!r}; use mode, topk, select, "
                             f"memory, seed or sft_only.")
    return c
