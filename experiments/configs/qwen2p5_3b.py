"""The paper's setup: a Qwen2.5-3B master and four Qwen2.5-3B sub-agents (one stacked group).

    joyagents train --config experiments/configs/qwen2p5_3b.py:/ckpt/Qwen2.5-3B-Instruct \\
        --workdir runs/3b --config.mesh=fsdp=-1
    launch/tpu_pod.sh my-tpu us-east5-a train --config experiments/configs/qwen2p5_3b.py:/ckpt/...

The arg is a local HF folder (config.json, *.safetensors, tokenizer files): weights, shapes and
the chat template come from it; nothing is downloaded. Check memory first with
`joyagents plan --config 3b+3b --mesh fsdp=8`.
"""

from joyagents_jax import config as config_lib


def get_config(checkpoint: str = ""):
    if not checkpoint:
        raise ValueError("qwen2p5_3b.py needs the checkpoint folder as its arg: "
                         "--config experiments/configs/qwen2p5_3b.py:/path/to/Qwen2.5-3B-Instruct")
    return config_lib.real_checkpoint_config({"all": (config_lib.get_config().agents, checkpoint)})
