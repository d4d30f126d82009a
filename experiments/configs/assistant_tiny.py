"""The embedded default (tiny agents with the suite BPE on the assistant suite), with ablation args.

    joyagents train --config experiments/configs/assistant_tiny.py --workdir runs/tiny
    joyagents train --config experiments/configs/assistant_tiny.py:mode=trajectory,topk=0,memory=off
    joyagents train --config experiments/configs/assistant_tiny.py:preset=bytes

Args (comma-separated key=value): preset (default | bytes: the byte-tokenizer
default of sessions 57-63, `config.byte_default()`), mode (nodewise | trajectory | full_tree),
topk (0 = all groups), select (groups | agents), memory (on | off), seed, sft_only (true: no
GRPO steps).
"""

from joyagents_jax import config as config_lib


def get_config(arg: str = ""):
    items = [item.partition("=")[::2] for item in filter(None, arg.split(","))]
    preset = dict(items).get("preset", "default")
    if preset not in ("default", "bytes"):
        raise ValueError(f"assistant_tiny.py: preset={preset!r}; use default or bytes.")
    c = config_lib.byte_default() if preset == "bytes" else config_lib.get_config()
    for key, value in items:
        if key == "preset":
            continue
        elif key == "mode":
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
            raise ValueError(f"assistant_tiny.py: unknown arg {key!r}; use preset, mode, topk, "
                             f"select, memory, seed or sft_only.")
    return c
