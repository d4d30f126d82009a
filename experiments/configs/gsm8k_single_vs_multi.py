"""The seed's first experiment: single-agent vs multi-agent GRPO on GSM8K.

    joyagents train --config experiments/configs/gsm8k_single_vs_multi.py:single,/ckpt/Qwen2.5-3B-Instruct \\
        --config.gsm8k_dir=/data/gsm8k --workdir runs/gsm8k_single
    joyagents train --config experiments/configs/gsm8k_single_vs_multi.py:multi,/ckpt/Qwen2.5-3B-Instruct \\
        --config.gsm8k_dir=/data/gsm8k --workdir runs/gsm8k_multi

Arg: `single` or `multi`, then optionally a local Qwen2.5 HF folder. single: the master reasons
and answers alone (one policy). multi: the master hands each problem to the math sub-agent
(its own policy) and relays the answer; both see the same reasoning in SFT, so the comparison
isolates the hierarchy. gsm8k_dir holds train.jsonl and test.jsonl from
github.com/openai/grade-school-math (nothing is downloaded). Without a checkpoint the agents
are tiny random byte-level models: a smoke test of the pipeline, far too small to solve GSM8K.
"""

from joyagents_jax import config as config_lib


def get_config(arg: str = "multi"):
    mode, _, checkpoint = arg.partition(",")
    if mode not in ("single", "multi"):
        raise ValueError(f"gsm8k_single_vs_multi.py: the arg starts with single or multi, got "
                         f"{mode!r}; e.g. ...gsm8k_single_vs_multi.py:multi,/ckpt/Qwen2.5-3B.")
    agents = ("master",) if mode == "single" else ("master", "math")
    if checkpoint:
        c = config_lib.real_checkpoint_config({"all": (agents, checkpoint)})
        c.limits.update(max_tokens_per_node=512)
    else:
        c = config_lib.get_config()
        c.tokenizer = "bytes"  # byte-level, as the docstring says: the "tiny" preset holds 264 ids
        c.groups = {"all": {"agents": agents, "model": "tiny", "checkpoint": ""}}
        c.max_len = 1024
        c.limits.update(max_tokens_per_node=384, max_observation_chars=384)
    c.agents = agents
    c.dataset = "gsm8k"
    c.limits.update(max_nodes=1 if mode == "single" else 4)
    c.eval.splits = ("test",)
    c.grpo.topk = 0  # two agents at most: keep every informative node group
    c.grpo.branch_agents = ""  # both designs train every agent they have
    return c
