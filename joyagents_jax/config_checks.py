"""One validation pass over a whole run config, before anything is built or written.

`problems(config)` returns one line per mistake, each naming the key, the value and the fix;
`validate(config)` raises `ConfigError` with all of them. It checks the keys against the
embedded default (an unknown key is a typo, not a silent no-op), every enumerated field against
its choices, every number against its range, and the rules that join fields (agents and the
suite's domains, memory thresholds, batch divisibility on the mesh). It reads no data and loads
no weights: a bad config fails in seconds, before the suite is built.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import ml_collections

from joyagents_jax import config as config_lib
from joyagents_jax import sharding
from joyagents_jax.agents import protocol
from joyagents_jax.rl import rewards

ATTENTION_IMPLS = ("xla", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")
MODES = ("nodewise", "trajectory", "full_tree")
SELECTS = ("groups", "agents")
SELECT_SPLITS = ("train", "validation")  # where grpo.select_every's slice comes from
KLS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
ADVANTAGES = ("std", "no_std", "loo")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine")
SFT_ORDERS = ("random", "epochs")
MEMORY_GROUPS = ("keep", "drop")
QUERY_ORDERS = ("traffic", "questions")
UNBRANCHED_MEMORY = ("off", "eval", "all")
GSM8K_SPLITS = ("train", "test", "train_socratic", "test_socratic")
GROUP_KEYS = {"agents", "model", "checkpoint"}
# The assistant suite's domains route to all of these (cooperation chains qa/efc with math/gfc).
SUITE_SUB_AGENTS = config_lib.SUB_AGENTS


class ConfigError(ValueError):
    """The config has mistakes; the message lists each, one per line."""


def validate(c: ml_collections.ConfigDict) -> None:
    found = problems(c)
    if found:
        lines = "\n".join(f"  - {p}" for p in found)
        raise ConfigError(f"{len(found)} config problem(s):\n{lines}")


def problems(c: ml_collections.ConfigDict) -> list[str]:
    """Every mistake in `c`, one line each (empty when the config is valid)."""
    out = list(_unknown_keys(c, config_lib.get_config()))
    if out:  # later checks read the keys by name
        return out
    for check in (_top_level, _agents_and_groups, _lora, _sft, _grpo, _memory,
                  _eval_and_checkpoint, _mesh):
        out.extend(check(c))
    return out


# ----------------------------------------------------------------------------------------------
# Helpers: each yields a problem line or nothing.
# ----------------------------------------------------------------------------------------------


def _keys(c: ml_collections.ConfigDict, prefix: str = "") -> Iterator[str]:
    for k, v in c.items():
        path = f"{prefix}{k}"
        if isinstance(v, ml_collections.ConfigDict) and path != "groups":
            yield from _keys(v, f"{path}.")
        else:
            yield path


def _unknown_keys(c, default) -> Iterator[str]:
    known = set(_keys(default))
    for key in sorted(set(_keys(c)) - known):
        parent = key.rpartition(".")[0]
        siblings = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent)
        yield (f"config.{key}: unknown key (a typo?); the keys of "
               f"{'config.' + parent if parent else 'config'} are {', '.join(siblings)}.")
    for key in sorted(known - set(_keys(c))):
        yield f"config.{key}: missing; a config file must start from joyagents_jax.config.get_config()."
    if "groups" in c:
        for name, spec in c.groups.items():
            keys = set(spec.keys()) if isinstance(spec, ml_collections.ConfigDict) else set()
            if keys != GROUP_KEYS:
                yield (f"config.groups.{name}: has keys {sorted(keys)}; every group needs exactly "
                       f"agents, model and checkpoint.")


def _choice(c, key: str, choices) -> Iterator[str]:
    value = _get(c, key)
    if value not in choices:
        yield f"config.{key}={value!r}: not one of {', '.join(map(str, choices))}."


def _number(c, key: str, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, high_open: bool = False, integer: bool = False,
            why: str = "") -> Iterator[str]:
    """A finite number in [low, high] (open ends with *_open); integers where asked."""
    value, why = _get(c, key), f" ({why})" if why else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        yield f"config.{key}={value!r}: must be a number{why}."
        return
    if integer and not float(value).is_integer():
        yield f"config.{key}={value!r}: must be a whole number{why}."
        return
    if not math.isfinite(value):
        yield f"config.{key}={value!r}: must be finite{why}."
        return
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        yield f"config.{key}={value!r}: must be {' and '.join(filter(None, (lo, hi)))}{why}."


def _flag(c, key: str) -> Iterator[str]:
    if not isinstance(_get(c, key), bool):
        yield f"config.{key}={_get(c, key)!r}: must be True or False."


def _get(c, key: str) -> Any:
    for part in key.split("."):
        c = c[part]
    return c


def _all(*checks: Iterator[str]) -> Iterator[str]:
    for check in checks:
        yield from check


# ----------------------------------------------------------------------------------------------
# Sections.
# ----------------------------------------------------------------------------------------------


def _top_level(c) -> Iterator[str]:
    from joyagents_jax.data import assistant_suite

    yield from _all(_number(c, "seed", low=0, integer=True),
                    _number(c, "init_seed", low=-1, integer=True, why="-1 uses config.seed"),
                    _choice(c, "dataset", ("assistant_suite", "gsm8k")),
                    _choice(c, "param_dtype", DTYPES), _choice(c, "dtype", DTYPES),
                    _choice(c, "attention_impl", ATTENTION_IMPLS), _flag(c, "remat"),
                    _flag(c, "pad_to_max_len"), _flag(c, "restart"),
                    _number(c, "max_len", low=2, integer=True),
                    _number(c, "pad_rows_to", low=0, integer=True),
                    _number(c, "agents_per_pass", low=0, integer=True,
                            why="0 runs every agent of a group in one pass"),
                    _number(c, "max_skipped_steps", low=1, integer=True,
                            why="consecutive non-finite steps before the run stops"),
                    _number(c, "sampler.min_prompt_bucket", low=1, integer=True),
                    _number(c, "sampler.min_batch_bucket", low=1, integer=True),
                    _number(c, "sampler.decode_phases", low=1, integer=True),
                    _number(c, "limits.max_nodes", low=1, integer=True),
                    _number(c, "limits.max_tokens_per_node", low=1, integer=True),
                    _number(c, "limits.max_observation_chars", low=1, integer=True))
    if c.dataset == "assistant_suite":
        yield from _choice(c, "suite", tuple(assistant_suite.CONFIGS))
    if c.dataset == "gsm8k" and not c.gsm8k_dir:
        yield ("config.gsm8k_dir is empty: config.dataset=gsm8k needs a folder with train.jsonl "
               "and test.jsonl from github.com/openai/grade-school-math.")
    if c.tokenizer not in ("bytes", "suite_bpe") and not os.path.isdir(c.tokenizer):
        yield (f"config.tokenizer={c.tokenizer!r}: not a folder; use 'bytes', 'suite_bpe' or a "
               f"folder with an HF tokenizer (e.g. the Qwen2.5 checkpoint).")
    if c.tokenizer == "suite_bpe":
        yield from _suite_bpe_models(c)


def _suite_bpe_models(c) -> Iterator[str]:
    """A suite BPE needs randomly initialized preset models with room for its ids."""
    from joyagents_jax import tokenizers
    from joyagents_jax.models import presets

    for name, spec in c.groups.items():
        if spec.checkpoint:
            yield (f"config.groups.{name}.checkpoint is set with config.tokenizer='suite_bpe': a "
                   f"checkpoint has its own tokenizer; set config.tokenizer to its folder.")
        elif spec.model in presets.PRESETS and (
                presets.PRESETS[spec.model].vocab_size < tokenizers.SUITE_BPE_VOCAB):
            yield (f"config.groups.{name}.model={spec.model!r} has a vocabulary of "
                   f"{presets.PRESETS[spec.model].vocab_size}, fewer than a suite BPE's "
                   f"{tokenizers.SUITE_BPE_VOCAB} ids; use model 'tiny-bpe' with "
                   f"config.tokenizer='suite_bpe'.")


def _agents_and_groups(c) -> Iterator[str]:
    from joyagents_jax.models import presets

    agents = list(c.agents)
    if protocol.MASTER not in agents:
        yield f"config.agents={agents}: must include {protocol.MASTER!r} (the router)."
    if len(set(agents)) != len(agents):
        yield f"config.agents={agents}: lists an agent twice."
    unknown = [a for a in agents if a not in (protocol.MASTER, *SUITE_SUB_AGENTS)]
    if unknown:
        yield (f"config.agents: unknown agent(s) {unknown}; the sub-agents are "
               f"{', '.join(SUITE_SUB_AGENTS)}.")
    subs = set(agents) - {protocol.MASTER}
    if c.dataset == "assistant_suite" and not unknown and subs != set(SUITE_SUB_AGENTS):
        missing = sorted(set(SUITE_SUB_AGENTS) - subs)
        yield (f"config.agents={agents}: the assistant suite's domains (math, qa, efc, gfc, "
               f"cooperation) route to every sub-agent, and {missing} are missing; use all of "
               f"{(protocol.MASTER, *SUITE_SUB_AGENTS)}, or config.dataset=gsm8k for a master "
               f"with or without math.")
    if c.dataset == "gsm8k" and subs - {"math"}:
        yield (f"config.agents={agents}: config.dataset=gsm8k runs the master alone or with the "
               f"math sub-agent.")
    grouped = [a for spec in c.groups.values() for a in spec.agents]
    if sorted(grouped) != sorted(agents):
        yield (f"config.groups: must place every agent of config.agents exactly once; groups "
               f"hold {sorted(grouped)}, agents are {sorted(agents)}.")
    for name, spec in c.groups.items():
        if spec.checkpoint:
            if not os.path.isfile(os.path.join(spec.checkpoint, "config.json")):
                yield (f"config.groups.{name}.checkpoint={spec.checkpoint!r}: no config.json "
                       f"there; point it at a local HF folder (config.json + *.safetensors).")
        elif spec.model not in presets.PRESETS:
            yield (f"config.groups.{name}.model={spec.model!r}: not a preset; choose one of "
                   f"{', '.join(sorted(presets.PRESETS))}, or set checkpoint to an HF folder.")


def _lora(c) -> Iterator[str]:
    from joyagents_jax.models import lora

    yield from _all(_number(c, "lora.rank", low=0, integer=True, why="0 = full fine-tuning"),
                    _number(c, "lora.alpha", low=0, low_open=True))
    try:
        lora.LoRAConfig(1, targets=c.lora.targets)  # raises if the regex matches no projection
    except (re.error, TypeError, ValueError):
        yield (f"config.lora.targets={c.lora.targets!r}: must be a regex matching the whole name "
               f"of at least one projection of {', '.join(lora.PROJECTIONS)}, e.g. 'q|v'.")
    unknown = sorted({g for g in str(c.lora.groups).split(",") if g} - set(c.groups))
    if unknown:
        yield (f"config.lora.groups={c.lora.groups!r}: no agent group named {unknown}; list "
               f"groups of config.groups ({', '.join(c.groups)}) or leave it empty for all.")


def _sft(c) -> Iterator[str]:
    yield from _all(_number(c, "sft.steps", low=0, integer=True),
                    _number(c, "sft.shared_steps", low=0, integer=True),
                    _number(c, "sft.batch_per_agent", low=1, integer=True),
                    _number(c, "sft.learning_rate", low=0, low_open=True),
                    _number(c, "sft.warmup_steps", low=0, integer=True),
                    _number(c, "sft.weight_decay", low=0),
                    _number(c, "sft.clip_norm", low=0, low_open=True),
                    _number(c, "sft.extra_worlds", low=0, integer=True),
                    _flag(c, "sft.sorted_passes"),
                    _choice(c, "sft.order", SFT_ORDERS),
                    _number(c, "sft.demo_seed", low=-1, integer=True, why="-1 uses config.seed"),
                    *(_number(c, f"sft.demo_{k}", low=0, high=1, why="a rate")
                      for k in ("wrong_route", "wrong_tool", "redundant_call")))
    if c.sft.extra_worlds and c.dataset != "assistant_suite":
        yield (f"config.sft.extra_worlds={c.sft.extra_worlds}: other worlds exist only for the "
               f"assistant suite, not dataset={c.dataset!r}; set it to 0.")


def _grpo(c) -> Iterator[str]:
    g = c.grpo
    yield from _all(_number(c, "grpo.steps", low=0, integer=True),
                    _number(c, "grpo.seed", low=-1, integer=True, why="-1 uses config.seed"),
                    _number(c, "grpo.queries", low=1, integer=True),
                    _number(c, "grpo.group_size", low=2, integer=True,
                            why="GRPO compares G samples of one node"),
                    _choice(c, "grpo.mode", MODES),
                    _number(c, "grpo.topk", low=0, integer=True, why="0 keeps every node group"),
                    _choice(c, "grpo.select", SELECTS),
                    _number(c, "grpo.micro_batch", low=0, integer=True),
                    _number(c, "grpo.inner_steps", low=1, integer=True),
                    _number(c, "grpo.beta", low=0, why="the KL weight; 0 turns the KL off"),
                    _number(c, "grpo.eps_low", low=0, high=1, high_open=True),
                    _number(c, "grpo.eps_high", low=0),
                    _choice(c, "grpo.kl", KLS), _choice(c, "grpo.aggregation", AGGREGATIONS),
                    _choice(c, "grpo.advantage", ADVANTAGES),
                    _number(c, "grpo.neg_weight", low=0,
                            why="the scale of negative advantages; 1 is GRPO"),
                    _choice(c, "grpo.optimizer", OPTIMIZERS),
                    _number(c, "grpo.learning_rate", low=0, low_open=True),
                    _choice(c, "grpo.schedule", SCHEDULES),
                    _number(c, "grpo.warmup_steps", low=0, integer=True),
                    _number(c, "grpo.clip_norm", low=0, low_open=True),
                    _number(c, "grpo.temperature", low=0, low_open=True,
                            why="rollouts sample; evaluation is greedy anyway"),
                    _number(c, "grpo.top_p", low=0, high=1, low_open=True),
                    _number(c, "grpo.top_k", low=0, integer=True, why="0 = no top-k cut"),
                    _flag(c, "grpo.tempered_loss"), _flag(c, "grpo.memory_branches"),
                    _number(c, "grpo.memory_members", low=1, integer=True,
                            why="1: the stored output is one member of its node group"),
                    _flag(c, "grpo.gold_branches"), _flag(c, "grpo.share_identical"),
                    _flag(c, "grpo.suffix_credit"), _flag(c, "grpo.greedy_completions"),
                    _flag(c, "grpo.subagent_credit"),
                    _choice(c, "grpo.unbranched_memory", UNBRANCHED_MEMORY),
                    _choice(c, "grpo.memory_groups", MEMORY_GROUPS),
                    _choice(c, "grpo.query_order", QUERY_ORDERS),
                    _number(c, "grpo.query_power", low=0, high=1,
                            why="1: every train record; 0: one record per question"),
                    _number(c, "grpo.w_format", low=0), _number(c, "grpo.w_efficiency", low=0),
                    _number(c, "grpo.w_grounding", low=0, why="0 leaves R_G out"),
                    _choice(c, "grpo.grounding_match", rewards.GROUNDING_MATCHES),
                    _number(c, "grpo.min_groups", low=0, integer=True,
                            why="0 turns dynamic sampling off"),
                    _number(c, "grpo.max_refills", low=0, integer=True),
                    _number(c, "grpo.self_imitation", low=0, integer=True,
                            why="rows per agent of each step's supervised step; 0 = off"),
                    _number(c, "grpo.branch_min_change", low=0, high=1, high_open=True,
                            why="a chance that a sample differs from tau0's; 0 branches at "
                                "every node"),
                    _number(c, "grpo.replay", low=0, integer=True,
                            why="queries asked again the next step; 0 = off"),
                    _number(c, "grpo.select_every", low=0, integer=True,
                            why="GRPO steps between scorings of the policies; 0 = the last "
                                "step's policies"),
                    _number(c, "grpo.select_examples", low=1, integer=True,
                            why="records the policies are scored on"),
                    _choice(c, "grpo.select_split", SELECT_SPLITS))
    yield from _domain_repeats(c)
    if g.select_split == "validation" and g.select_every and c.dataset == "gsm8k":
        yield ("config.grpo.select_split=validation: GSM8K has no validation split (train and "
               "test only); use grpo.select_split=train, or grpo.select_every=0.")
    if isinstance(g.replay, int) and isinstance(g.queries, int) and g.replay >= g.queries >= 1:
        yield (f"config.grpo.replay={g.replay}: a step re-asks at most grpo.replay of the "
               f"previous step's queries in place of fresh ones, so it must stay below "
               f"grpo.queries={g.queries} for every step to see new traffic. Lower grpo.replay "
               f"(the default asks 12 of 36 again, e.g. --config.grpo.replay={g.queries // 3}; "
               f"0 asks fresh traffic only) or raise grpo.queries.")
    if g.memory_groups == "drop" and g.mode == "full_tree":
        yield ("config.grpo.memory_groups=drop: full_tree rollouts do not mark memory-answered "
               "episodes; use grpo.mode=nodewise or trajectory, or memory_groups=keep.")
    if g.gold_branches is True and g.mode != "nodewise":
        yield (f"config.grpo.gold_branches=True: a gold output joins node groups, which only "
               f"node-wise rollouts form; grpo.mode is {g.mode!r}. Use grpo.mode=nodewise or "
               f"gold_branches=False.")
    if g.suffix_credit is True and g.mode == "nodewise" and (g.topk or g.advantage != "std"):
        yield (f"config.grpo.suffix_credit=True: samples then carry their GRPO advantage "
               f"((r - mean) / std within the node group), so top-K has no reward variance to "
               f"rank and grpo.advantage has nothing to choose; got topk={g.topk}, "
               f"advantage={g.advantage!r}. Use grpo.topk=0 and advantage=std, or "
               f"suffix_credit=False.")
    if (isinstance(g.memory_members, int) and g.memory_members > 1 and g.mode == "nodewise"
            and g.suffix_credit is True):
        yield (f"config.grpo.memory_members={g.memory_members} with grpo.suffix_credit=True: "
               f"copies of the memory's member would change a group whose rewards are already "
               f"advantages. Set memory_members=1 or suffix_credit=False.")
    if (g.query_order == "questions" and isinstance(g.query_power, (int, float))
            and g.query_power != 1):
        yield (f"config.grpo.query_power={g.query_power} with grpo.query_order=questions: the "
               f"question order already keeps one record per question. Use "
               f"query_order=traffic with the power, or query_power=1.")
    if g.greedy_completions is True and g.tempered_loss is True and g.mode == "nodewise":
        yield ("config.grpo.greedy_completions=True with grpo.tempered_loss=True: greedy "
               "outputs have no log-probs under the tempered sampling distribution that loss "
               "scores. Set tempered_loss=False or greedy_completions=False.")
    if g.branch_min_change and g.greedy_completions is True and g.mode == "nodewise":
        yield (f"config.grpo.branch_min_change={g.branch_min_change}: it reads how likely a "
               f"sample repeats tau0's sampled output, and greedy_completions=True decodes tau0 "
               f"greedily. Set greedy_completions=False or branch_min_change=0.")
    if isinstance(g.self_imitation, int) and g.self_imitation > 0 and c.memory.enabled is False:
        yield (f"config.grpo.self_imitation={g.self_imitation}: it imitates the memory's best "
               f"entries, and memory.enabled is False. Set memory.enabled=True or "
               f"self_imitation=0.")
    listed = {a for a in str(g.branch_agents).split(",") if a}
    unknown = sorted(listed - {protocol.MASTER, *SUITE_SUB_AGENTS})
    if unknown:
        yield (f"config.grpo.branch_agents={g.branch_agents!r}: no agent named {unknown}; list "
               f"agents of config.agents ({', '.join(c.agents)}) comma-separated, or leave it "
               f"empty to branch at every agent's nodes.")
    elif listed and g.mode == "nodewise" and not listed & set(c.agents):
        yield (f"config.grpo.branch_agents={g.branch_agents!r}: lists none of config.agents "
               f"({', '.join(c.agents)}), so no node group forms and GRPO trains nothing; list "
               f"some of them, or leave it empty to branch at every agent's nodes.")
    for key, value, what in (("grpo.micro_batch", g.micro_batch,
                              "(rows per agent in one forward/backward) or 0 (the whole batch)"),
                             ("pad_rows_to", c.pad_rows_to,
                              "or 0 (rows padded to the power of two of the step's own count)")):
        if isinstance(value, int) and value > 0 and value & (value - 1):
            yield f"config.{key}={value}: must be a power of two {what}."


def _domain_repeats(c) -> Iterator[str]:
    from joyagents_jax.data import assistant_suite

    text = c.grpo.domain_repeats  # a string: ConfigDict refuses another type
    try:
        repeats = config_lib.domain_repeats(text)
    except ValueError as e:
        yield (f"config.grpo.domain_repeats={text!r}: {e}; write e.g. 'cooperation=2' or "
               f"'cooperation=2,math=3' ('' asks every record once).")
        return
    domains = assistant_suite.DOMAINS if c.dataset == "assistant_suite" else ("math",)
    for domain in repeats:
        if domain not in domains:
            yield (f"config.grpo.domain_repeats={text!r}: {c.dataset} has no domain "
                   f"{domain!r}; its domains are {', '.join(domains)}.")


def _memory(c) -> Iterator[str]:
    yield from _all(_flag(c, "memory.enabled"), _flag(c, "memory.hints"),
                    _flag(c, "memory.reuse"), _flag(c, "memory.in_rollouts"),
                    _number(c, "memory.capacity", low=1, integer=True),
                    _number(c, "memory.response_len", low=1, integer=True),
                    _number(c, "memory.request_len", low=1, integer=True),
                    _number(c, "memory.embed_batch", low=1, integer=True),
                    *(_number(c, f"memory.{k}", low=-1, high=1, why="a cosine similarity")
                      for k in ("tau_reuse", "tau_hint", "tau_dup")),
                    _number(c, "memory.reuse_min_reward"),
                    _number(c, "memory.z", low=0, low_open=True),
                    _number(c, "memory.decay_steps", low=0, low_open=True),
                    _number(c, "memory.alpha", low=0), _number(c, "memory.beta", low=0))
    m = c.memory
    if _finite(m.tau_hint) and _finite(m.tau_reuse) and m.tau_hint > m.tau_reuse:
        yield (f"config.memory.tau_hint={m.tau_hint} > tau_reuse={m.tau_reuse}: a hint is a "
               f"weaker match than a reuse; set tau_hint <= tau_reuse.")


def _eval_and_checkpoint(c) -> Iterator[str]:
    from joyagents_jax.data import assistant_suite

    yield from _all(_number(c, "eval.sft_every", low=0, integer=True,
                            why="0 evaluates only at the end of SFT"),
                    _number(c, "eval.grpo_every", low=0, integer=True,
                            why="0 evaluates only at the end of GRPO"),
                    _number(c, "eval.examples", low=0, integer=True, why="0 = the whole split"),
                    _number(c, "checkpoint.every", low=0, integer=True,
                            why="0 saves only at phase ends and on preemption"),
                    _number(c, "checkpoint.keep", low=1, integer=True))
    splits = GSM8K_SPLITS if c.dataset == "gsm8k" else assistant_suite.SPLITS
    bad = [s for s in c.eval.splits if s not in splits]
    if bad or not c.eval.splits:
        yield (f"config.eval.splits={list(c.eval.splits)}: each must be one of "
               f"{', '.join(splits)} (and at least one).")


def _mesh(c) -> Iterator[str]:
    import jax

    if not c.mesh:
        if jax.process_count() > 1:  # process 0's device: the others' arrays would be empty
            yield (f"config.mesh='': keeps every array on one device, process 0's, which the "
                   f"other {jax.process_count() - 1} process(es) of this job cannot reach; give "
                   f"the job a mesh over its {jax.device_count()} devices, e.g. "
                   f"--config.mesh=fsdp=-1 (or data={jax.process_count()},fsdp=-1).")
        return
    try:
        sizes = sharding.mesh_shape(sharding.parse_mesh(c.mesh), jax.device_count())
    except sharding.ShardingError as e:
        yield f"config.mesh={c.mesh!r}: {e}"
        return
    if sizes["agent"] > 1 and c.agents_per_pass:
        yield (f"config.agents_per_pass={c.agents_per_pass}: runs a group's agents one pass "
               f"after another, but config.mesh={c.mesh!r} splits them over {sizes['agent']} "
               f"devices on its agent axis to run side by side; set agents_per_pass=0 or drop "
               f"the agent axis from the mesh.")
    rows = sharding.data_parallel_size(sizes)
    if isinstance(c.sft.batch_per_agent, int) and c.sft.batch_per_agent % rows:
        yield (f"config.sft.batch_per_agent={c.sft.batch_per_agent}: not divisible by the "
               f"mesh's data x fsdp size {rows}; use a multiple of {rows}.")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

