"""A Qwen2.5-7B master with four Qwen2.5-3B sub-agents: two agent groups of different sizes.

    joyagents train --config experiments/configs/qwen2p5_7b_master.py:/ckpt/Qwen2.5-7B-Instruct,/ckpt/Qwen2.5-3B-Instruct \\
        --workdir runs/7b3b

The arg is "MASTER_FOLDER,SUB_AGENT_FOLDER" (local HF folders). Both Qwen2.5 sizes share one
tokenizer; the master's folder provides it. Plan memory with `joyagents plan --config 7b+3b`.
"""

from joyagents_jax import config as config_lib


def get_config(arg: str = ""):
    master, _, subs = arg.partition(",")
    if not master or not subs:
        raise ValueError("qwen2p5_7b_master.py needs 'MASTER_FOLDER,SUB_AGENT_FOLDER' as its arg.")
    return config_lib.real_checkpoint_config({"master": (("master",), master),
                                              "subs": (config_lib.SUB_AGENTS, subs)})
