"""Everything a run is built from a config: tokenizer, suite, agent system, state, steps.

`Experiment` owns no mutable training state: `sft_iteration` and `grpo_iteration` take a
`RunState` and return the next one, and `evaluate` only reads it, so the train loop, checkpoints
and resume see every piece of state explicitly. Randomness derives from (seed, step), so a
resumed run draws exactly what an uninterrupted one draws.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import random
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from joyagents_jax import batching, checkpoint, sft, sharding
from joyagents_jax import components, config_checks, distributed
from joyagents_jax import config as config_lib
from joyagents_jax import train_state as ts
from joyagents_jax.agents import demonstrator, protocol, system
from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.models import hf_io, lora, presets, qwen2
from joyagents_jax.rl import grpo_step, memory_hook, rollout
from joyagents_jax.rl import memory as mem
from joyagents_jax.rl import self_imitation
from joyagents_jax import run_state, selection
from joyagents_jax.run_state import RunState
from joyagents_jax.sampling import Sampler
from joyagents_jax.tokenizers import (BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer,
                                      train_suite_bpe)

# The GRPO step's counts logged as grpo/<name> each step (0 where no step ran).
STEP_COUNTS = ("kept_groups", "mixed_groups", "offpolicy_kept_groups", "offpolicy_mixed_groups",
               "updated_agents", "skipped")


def task_of(ex: suite.Example) -> rollout.Task:
    return rollout.Task(ex.query, ex.answer, ex.answer_kind, ex.min_llm_calls,
                        tuple(n.output for n in ex.gold))


def load_sources(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Random-access splits of suite-format records: the assistant suite, or GSM8K (multi-agent
    when the math sub-agent is among the agents)."""
    data_dir = config.data_dir or f"{workdir}/data"
    if config.dataset == "gsm8k":
        from joyagents_jax.data import gsm8k

        try:
            return gsm8k.as_suite(config.gsm8k_dir, data_dir, multi_agent="math" in config.agents)
        except FileNotFoundError as e:
            raise ValueError(f"config.gsm8k_dir: {e}") from e
    return suite.load_suite(config.suite, data_dir)


class Experiment:
    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        config_checks.validate(config)
        self.config, self.workdir = config, workdir
        # The demonstrator's detours: `sft.demo_seed`, or `seed` (-1); a dataset across seeds.
        self.demo_seed = config.seed if config.sft.demo_seed < 0 else config.sft.demo_seed
        # The agents' random initial weights: `init_seed`, or `seed` (-1).
        self.init_seed = config.seed if config.init_seed < 0 else config.init_seed
        self.parts = components.build(config)
        self.sources = distributed.primary_first(  # process 0 prepares the data once
            "load_sources", lambda: load_sources(config, workdir))
        if config.grpo.select_every:  # the records `select` scores the policies on
            pool = self.sources[config.grpo.select_split]
            self.sources["select"] = [pool[i] for i in selection.slice_rows(
                len(pool), config.grpo.select_examples)]
        self.system = system.make_system(suite.suite_world(config.suite),
                                         agents=[a for a in config.agents if a != protocol.MASTER],
                                         limits=self.parts.limits)
        try:
            self.tokenizer = load_tokenizer(self._tokenizer_folder())
        except (OSError, ValueError) as e:
            raise ValueError(f"config.tokenizer: {e}") from e
        self.slots = {a: (g, i) for g, spec in config.groups.items()
                      for i, a in enumerate(spec.agents)}
        self.models = {}
        for g, spec in config.groups.items():
            try:
                self.models[g] = self._model(spec)
            except (OSError, ValueError) as e:
                raise ValueError(f"config.groups.{g}: {e}") from e
        for g, m in self.models.items():
            if m.vocab_size < self.tokenizer.vocab_size:
                raise ValueError(f"config.groups.{g}: the model's vocabulary ({m.vocab_size}) is "
                                 f"smaller than the tokenizer's ({self.tokenizer.vocab_size}); "
                                 f"use the checkpoint's own tokenizer (config.tokenizer).")
        self.group_sizes = {g: len(spec.agents) for g, spec in config.groups.items()}
        self.offsets = ts.offsets_of_sizes(self.group_sizes)
        self.mesh = sharding.make_mesh(config.mesh) if config.mesh else None
        per_pass = config.agents_per_pass or None
        self.samplers = {g: Sampler(m, pad_id=self.tokenizer.pad_id, tokenizer=self.tokenizer,
                                    min_prompt_bucket=config.sampler.min_prompt_bucket,
                                    min_batch_bucket=config.sampler.min_batch_bucket,
                                    decode_phases=config.sampler.decode_phases,
                                    mesh=self.mesh, agents_per_pass=per_pass)
                         for g, m in self.models.items()}
        self.min_rows = sharding.data_parallel_size(dict(self.mesh.shape)) if self.mesh else 1
        if config.sft.batch_per_agent % self.min_rows:
            raise ValueError(f"config.sft.batch_per_agent {config.sft.batch_per_agent} is not "
                             f"divisible by the mesh's data x fsdp size {self.min_rows}; use a "
                             f"multiple of it.")
        self.demos = self._demonstrations(self._demonstration_texts(self.tokenizer))
        self.grpo_pool = self._grpo_pool()
        # GRPO's draws: `grpo.seed`, or `seed` (-1), so RL seeds can share one SFT phase.
        self.grpo_seed = config.seed if config.grpo.seed < 0 else config.grpo.seed
        self._makers = {"sft": functools.partial(sft.make_sft_step, agents_per_pass=per_pass),
                        "shared_sft": functools.partial(sft.make_sft_step, shared=True,
                                                        agents_per_pass=per_pass),
                        "grpo": functools.partial(grpo_step.make_grpo_step, self.parts.grpo_step),
                        "self_imitation": functools.partial(sft.make_sft_step,
                                                            agents_per_pass=per_pass)}
        self._jitted = {}
        self.memory = (memory_hook.Context(self.system, self.tokenizer, self.slots,
                                           self.parts.memory)
                       if config.memory.enabled else None)

    # -- construction ------------------------------------------------------------------------

    def _model(self, spec) -> qwen2.Qwen2Config:
        kw = dict(param_dtype=self.config.param_dtype, dtype=self.config.dtype,
                  remat=self.config.remat, attention_impl=self.config.attention_impl)
        if spec.checkpoint:
            return hf_io.config_from_hf(spec.checkpoint, **kw)
        return presets.get_preset(spec.model, **kw)

    def init_run(self) -> RunState:
        """Step 0: random or checkpoint-loaded agents, SFT optimizer, no memory yet."""
        run = RunState.start(self._init_train())
        return run.replace(step=sharding.replicate(run.step, self.mesh))

    def _init_train(self) -> ts.TrainState:
        """Random or checkpoint-loaded agents, SFT optimizer, reference = initial params; LoRA
        groups without a shared SFT phase get their adapters over the initial base now."""
        key = jax.random.key(self.init_seed)
        groups = {}
        for i, (g, spec) in enumerate(sorted(self.config.groups.items())):
            model, n = self.models[g], len(spec.agents)
            if spec.checkpoint or self.config.sft.shared_steps or self.parts.lora[g]:
                base = (hf_io.load_params(spec.checkpoint, model)[0] if spec.checkpoint else
                        qwen2.init_params(model, jax.random.fold_in(key, i)))
                if self.parts.lora[g] and self.lora_from_step(0):
                    groups[g] = self._lora_group(g, model, base, self.parts.sft_optim)
                else:  # one base policy, copied to every agent
                    groups[g] = ts.init_group(model, self.parts.sft_optim,
                                              ts.stack_agents([base] * n))
            else:
                groups[g] = ts.init_random_group(model, self.parts.sft_optim, n,
                                                 jax.random.fold_in(key, i))
        return self._place(ts.create(groups))

    def _lora_group(self, g: str, model: qwen2.Qwen2Config, base: qwen2.Params,
                    optim: ts.OptimConfig) -> ts.AgentGroup:
        """Group g's agents as fresh adapters (zero b: each agent is the base) over `base`."""
        cfg, n = self.parts.lora[g], self.group_sizes[g]
        key = jax.random.fold_in(jax.random.key(self.init_seed), 3_000_017 + sorted(
            self.config.groups).index(g))
        adapters = ts.stack_agents([lora.init_adapters(base, cfg, k)
                                    for k in jax.random.split(key, n)])
        return ts.init_group(model, optim, adapters, base=base, lora=cfg)

    # -- LoRA: adapters from the end of the shared SFT phase on ------------------------------

    def lora_from_step(self, step: int) -> bool:
        """Whether the state after `step` steps holds the LoRA groups' adapters: from step 0
        without a shared SFT phase, else once the step after that phase has begun."""
        shared = min(self.config.sft.shared_steps, self.config.sft.steps)  # SFT may end first
        return any(self.parts.lora.values()) and (not shared or step > shared)

    def lora_pending(self, run: RunState) -> bool:
        """The next step trains adapters that `run` does not have yet."""
        return self.lora_from_step(int(run.step) + 1) and any(
            self.parts.lora[g] and grp.lora is None for g, grp in run.train.groups.items())

    def to_lora(self, run: RunState) -> RunState:
        """After the shared SFT phase: each LoRA group's base is its (common) policy, frozen,
        and its agents start adapters that reproduce it exactly, with the phase's optimizer."""
        optim = self.parts.sft_optim if run.phase == "sft" else self.parts.grpo_optim
        groups = dict(run.train.groups)
        for g, grp in groups.items():
            if self.parts.lora[g] and grp.lora is None:
                base = jax.tree.map(lambda x: x[0], grp.params)  # agents are equal after it
                groups[g] = self._lora_group(g, grp.model, base, optim)
        return run.replace(train=self._place(run.train.replace(groups=groups)))

    def bases_dir(self, group: str) -> str:
        return os.path.join(self.workdir, "lora_base", group)

    def save_bases(self, run: RunState) -> None:
        """Writes each LoRA base that training produced (the shared SFT result) once, since
        checkpoints hold only adapters; bases from step 0 are rebuilt from the config."""
        if self.lora_from_step(0):
            return
        for g, grp in run.train.groups.items():
            if grp.lora is not None:
                checkpoint.save_tree(self.bases_dir(g), grp.base)

    def attach_bases(self, run: RunState, fresh: RunState) -> RunState:
        """`run` restored from a checkpoint (LoRA bases absent) with its bases back: saved by
        `save_bases`, or those of the fresh state `fresh` when LoRA starts at step 0."""
        if all(grp.lora is None for grp in run.train.groups.values()):
            return run
        groups = dict(run.train.groups)
        for g, grp in groups.items():
            if grp.lora is None:
                continue
            if not self.lora_from_step(0):  # shaped like one agent of the fresh full params
                shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                                      fresh.train.groups[g].params)
                base = checkpoint.restore_tree(self.bases_dir(g), shapes)
            else:
                base = fresh.train.groups[g].base
            groups[g] = grp.replace(base=base)
        return run.replace(train=self._place(run.train.replace(groups=groups)))

    def start_grpo(self, run: RunState) -> RunState:
        """After SFT: freeze the reference policy (LoRA: the adapters at the end of SFT), switch
        to the GRPO optimizer, and start empty memory tables (none when the memory is off)."""
        if self.lora_pending(run):
            run = self.to_lora(run)
        groups = {n: ts.init_group(g.model, self.parts.grpo_optim, g.params, base=g.base,
                                   lora=g.lora)
                  for n, g in run.train.groups.items()}
        train = self._place(run.train.replace(groups=groups))
        tables = ({} if self.memory is None else sharding.replicate(memory_hook.init_tables(
            self.parts.memory, memory_hook.group_models(train)), self.mesh))
        replay = self._replay_array([]) if self.config.grpo.replay else run_state.OFF
        selected = (self._placed(selection.start(train)) if self.config.grpo.select_every
                    else run_state.OFF)
        return run.replace(train=train, memory=tables, replay=replay, selected=selected,
                           phase="grpo")

    def _place(self, state: ts.TrainState) -> ts.TrainState:
        """The state in its partition-rule shardings on the mesh, or committed to the one
        device without a mesh: the jitted steps' outputs are committed, and a step called
        first with uncommitted arrays would compile twice."""
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        return sharding.place(state, ts.state_shardings(state, self.mesh))

    def _batch_shardings(self, batch):
        """Per-agent arrays split over agents and data-parallel devices; tables replicated."""
        if isinstance(batch, grpo_step.GRPOBatch):
            return grpo_step.batch_shardings(batch, self.mesh)
        return ts.agent_batch_shardings(batch, self.mesh)

    def _run_step(self, name: str, state: ts.TrainState, batch) -> tuple[ts.TrainState, dict]:
        """The jitted step `name` (built at first use) on host `batch`; metrics on the host.

        On a mesh, its in/out shardings are explicit: the state's partition rules, the batch
        over agents and data-parallel axes (each process places only its own devices' rows),
        the metrics replicated.
        """
        if name not in self._jitted:
            kw = {}
            if self.mesh is not None:
                state_sh = ts.state_shardings(state, self.mesh)
                kw = dict(in_shardings=(state_sh, self._batch_shardings(batch)),
                          out_shardings=(state_sh, NamedSharding(self.mesh, P())))
            self._jitted[name] = self._makers[name](**kw)
        if self.mesh is not None:
            batch = jax.device_put(batch, self._batch_shardings(batch))
        state, m = self._jitted[name](state, batch)
        return state, distributed.to_host(m)

    def _demo_examples(self) -> list[tuple[system.AgentSystem, str, suite.Example]]:
        """(system, detour-seed prefix, example) of every train example, then of the train
        traffic of `sft.extra_worlds` other worlds of the suite (their own entities and question
        pools): demonstrations whose answers the policies cannot memorize, only copy."""
        source = self.sources["train"]
        out = [(self.system, "", suite.decode(source[i])) for i in range(len(source))]
        base = suite.CONFIGS.get(self.config.suite)
        for k in range(1, self.config.sft.extra_worlds + 1):
            other = dataclasses.replace(base, world_seed=base.world_seed + k, seed=base.seed + k)
            world_system = system.make_system(
                suite.suite_world(other), limits=self.parts.limits,
                agents=[a for a in self.system.agents if a != protocol.MASTER])
            out += [(world_system, f"{k}/", suite.decode(r))
                    for r in suite.generate_splits(other)["train"]]
        return out

    def _tokenizer_folder(self) -> str:
        """config.tokenizer, or for "suite_bpe" the run's own BPE in <workdir>/tokenizer,
        trained once (by process 0) on the demonstrations' ChatML text, read back on resume."""
        if self.config.tokenizer != "suite_bpe":
            return self.config.tokenizer
        folder = os.path.join(self.workdir, "tokenizer")

        def build():  # every process enters the barrier; the others find the file
            if not os.path.isfile(os.path.join(folder, BPETokenizer.FILE)):
                texts = self._demonstration_texts(ByteTokenizer())
                train_suite_bpe((prompt + output for _, prompt, output in texts), folder)

        distributed.primary_first("suite_bpe", build)
        return folder

    def _demonstration_texts(self, chat: Tokenizer) -> list[tuple[str, str, str]]:
        """(agent, prompt text, output text) of every node of one demonstration of every
        train example (`_demo_examples`): its gold trajectory, with the configured
        demonstrator's detours; prompts in `chat`'s template."""
        texts = []
        examples = self._demo_examples()
        outputs = [demonstrator.outputs(agents, [(n.agent, n.output) for n in ex.gold],
                                        self.parts.demonstrator,
                                        random.Random(f"{self.demo_seed}/demo/{prefix}{i}"))
                   for i, (agents, prefix, ex) in enumerate(examples)]
        most = max(map(len, outputs))
        if most > self.parts.limits.max_nodes:
            raise ValueError(f"config.limits.max_nodes={self.parts.limits.max_nodes}: the "
                             f"longest SFT demonstration has {most} LLM nodes, more than an "
                             f"episode may have; raise limits.max_nodes to at least {most}, or "
                             f"lower the sft.demo_* rates.")
        for (agents, _, ex), nodes in zip(examples, outputs):
            episode = system.demonstration(agents, ex.query, nodes)
            for node in episode.nodes:
                prompt = protocol.render_prompt(chat, self.system.specs[node.agent],
                                                node.query, node.turns)
                texts.append((node.agent, prompt, node.output))
        return texts

    def _demonstrations(self, texts: Sequence[tuple[str, str, str]]
                        ) -> dict[str, list[tuple[list[int], list[int]]]]:
        """Per agent, (context ids, output ids) of the demonstrations' nodes (`texts`)."""
        demos = collections.defaultdict(list)
        for agent, prompt, output in texts:
            demos[agent].append((self.tokenizer.encode(prompt), self.tokenizer.encode(output)))
        longest = max(len(c) + len(o) for pool in demos.values() for c, o in pool)
        if longest > self.config.max_len:  # found now, not at the SFT step that draws it
            raise ValueError(f"config.max_len={self.config.max_len}: the longest SFT "
                             f"demonstration has {longest} tokens (context and output); raise "
                             f"max_len to at least {longest}, or lower the sft.demo_* rates.")
        return demos

    # -- steps -------------------------------------------------------------------------------

    def sft_iteration(self, run: RunState) -> tuple[RunState, dict[str, float]]:
        """One SFT step on `sft.batch_per_agent` demonstrations of every agent."""
        step = int(run.step)
        batch = [(agent, *self.demos[agent][j])
                 for agent, rows in self.sft_rows(step).items() for j in rows]
        shared = step < self.config.sft.shared_steps
        if shared and self.config.sft.sorted_passes:
            if "sorted_sft" not in self._jitted:
                self._jitted["sorted_sft"] = sft.make_sorted_sft_step(self.mesh)
            passes = batching.sorted_passes(batch, self.slots, self.group_sizes,
                                            self.config.sft.batch_per_agent, self.config.max_len)
            train, m = self._jitted["sorted_sft"](run.train, passes)
            m = distributed.to_host(m)
        else:
            arrays = batching.sft_batch(batch, self.slots, self.group_sizes, self.config.max_len,
                                        self.min_rows)
            train, m = self._run_step("shared_sft" if shared else "sft", run.train, arrays)
        metrics = self._per_agent(m["agents"], "sft")
        metrics["sft/loss"] = float(np.mean([metrics[f"sft/loss/{a}"] for a in self.config.agents]))
        metrics["sft/skipped"] = float(m["skipped"])
        return run.next(train), metrics

    def sft_rows(self, step: int) -> dict[str, list[int]]:
        """SFT step `step`'s demonstrations, per agent as indices into `self.demos[agent]`:
        `sft.batch_per_agent` draws with replacement ("random"), or the next ones of a seeded
        permutation of the agent's demonstrations per epoch ("epochs": each once an epoch)."""
        b = self.config.sft.batch_per_agent
        if self.config.sft.order == "random":
            rng = np.random.default_rng([self.config.seed, step])
            return {a: [int(j) for j in rng.integers(0, len(self.demos[a]), b)]
                    for a in self.config.agents}
        rows = {}
        for i, agent in enumerate(self.config.agents):
            n = len(self.demos[agent])
            first, last = step * b // n, ((step + 1) * b - 1) // n
            orders = np.concatenate([np.random.default_rng([self.config.seed, 17, i, e])
                                     .permutation(n) for e in range(first, last + 1)])
            rows[agent] = orders[step * b - first * n:(step + 1) * b - first * n].tolist()
        return rows

    def _grpo_pool(self) -> list[int]:
        """The train records GRPO draws queries from (`grpo.query_order`, `grpo.query_power`,
        `grpo.domain_repeats`): of a question with n train records, its first ceil(n ** p) in
        traffic order (p = 1: all of them), the first one in question order; each kept record
        as many times as its domain's repeat (1 when not named)."""
        source = self.sources["train"]
        g = self.config.grpo
        repeats = config_lib.domain_repeats(g.domain_repeats)
        if g.query_order == "traffic" and g.query_power == 1 and not repeats:
            return list(range(len(source)))
        examples = [suite.decode(source[i]) for i in range(len(source))]
        records = collections.defaultdict(list)
        for i, example in enumerate(examples):
            records[example.question_id].append(i)
        p = g.query_power if g.query_order == "traffic" else 0.0
        kept = sorted(i for rows in records.values() for i in rows[:math.ceil(len(rows) ** p)])
        return [i for i in kept for _ in range(repeats.get(examples[i].domain, 1))]

    def train_records(self, k: int) -> list[int]:
        """GRPO step k's fresh queries as train record indices: a seeded permutation of the
        pool per epoch, read in order."""
        pool, q = self.grpo_pool, self.config.grpo.queries
        out = []
        for i in range(k * q, (k + 1) * q):
            epoch, pos = divmod(i, len(pool))
            order = np.random.default_rng([self.grpo_seed, 7, epoch]).permutation(len(pool))
            out.append(pool[int(order[pos])])
        return out

    def task(self, record: int) -> rollout.Task:
        return task_of(suite.decode(self.sources["train"][record]))

    def train_tasks(self, k: int) -> list[rollout.Task]:
        """GRPO step k's fresh queries."""
        return [self.task(i) for i in self.train_records(k)]

    @staticmethod
    def replayed(run: RunState) -> list[int]:
        """The train records `run.replay` re-asks (none with replay off)."""
        return [int(i) for i in distributed.to_host(run.replay) if i >= 0] if run.replays else []

    def step_records(self, replayed: list[int], k: int) -> list[int]:
        """GRPO step k's train records: the `replayed` ones (`replayed(run)`), then step k's
        fresh ones up to `grpo.queries` in all."""
        fresh = self.train_records(k)
        return replayed + fresh[:len(fresh) - len(replayed)]

    def next_replay(self, records: Sequence[int], samples: Sequence[rollout.Sample]
                    ) -> jax.Array:
        """[R] int32 (R = `grpo.replay`): the step's queries (`records`, in the rollout's order)
        that had a node group with a reward spread, the first R of them, so the next step asks
        them again while the memory holds this step's best outputs for them; -1 pads."""
        spread = sorted({s.query for s in batching.informative(samples) if s.query < len(records)})
        return self._replay_array([records[q] for q in spread][:int(self.config.grpo.replay)])

    def _replay_array(self, records: list[int]) -> jax.Array:
        padded = records + [-1] * (int(self.config.grpo.replay) - len(records))
        return sharding.replicate(jax.numpy.asarray(padded, jax.numpy.int32), self.mesh)

    def policy(self, train: ts.TrainState, key: jax.Array, greedy: bool = False
               ) -> rollout.SamplerPolicy:
        scfg = dataclasses.replace(self.parts.sampling, greedy=greedy)
        policy = rollout.SamplerPolicy(self.samplers, self.slots, scfg, self.tokenizer, key,
                                       tempered=self.config.grpo.tempered_loss)
        policy.params = {g: grp.policies for g, grp in train.groups.items()}
        return policy

    def memory_view(self, run: RunState, agents: tuple[str, ...] = ()
                    ) -> memory_hook.MemoryView | None:
        """The run's memory for a rollout, read-only (None before GRPO or when it is off);
        `agents`: only theirs is read (empty: every agent's)."""
        if self.memory is None or not run.memory:
            return None
        return memory_hook.MemoryView(self.memory, run.memory,
                                      memory_hook.group_models(run.train), agents)

    def grpo_iteration(self, run: RunState) -> tuple[RunState, dict[str, float]]:
        """One JoyAgents-R1 iteration over the step's queries, as the method reads:

        1. sample each query's initial trajectory and branch its nodes (node-wise Monte Carlo;
           `grpo.mode` picks the trajectory or full-tree baselines), the memory answering the
           nodes it holds; score every episode with R = R_A + R_F - R_E (dynamic sampling,
           when on, adds queries until enough node groups have a reward spread);
        2. build the batch from the node groups that have a reward spread;
        3. the marginal-benefit update: each agent's top-K node groups by reward variance, one
           clipped GRPO step of every selected agent;
        4. the memory update, fed by the same rollout's rewards;
        5. with `grpo.self_imitation`, a supervised step on the memory's best entries;
        6. with `grpo.replay`, the queries the next step asks again.
        """
        start, k = time.perf_counter(), int(run.step) - self.config.sft.steps
        replayed = self.replayed(run)
        records = self.step_records(replayed, k)
        result, refills = self._rollout(run, k, [self.task(i) for i in records])
        metrics = self._rollout_metrics(result, time.perf_counter() - start)
        metrics["rollout/refills"] = refills
        metrics["rollout/replayed"] = len(replayed)
        trained = self._trainable(result.samples, metrics)
        train = run.train
        if trained:  # else no node group has a reward spread: nothing to learn, no step
            train = self._update(train, trained, metrics)
        tables = run.memory
        if tables:
            memory_start = time.perf_counter()
            tables, m = memory_hook.update(self.memory, tables, memory_hook.group_models(train),
                                           result, int(run.step))
            tables = sharding.replicate(tables, self.mesh)
            metrics.update({f"memory/{name}": v for name, v in m.items()})
            metrics["time/memory_update_seconds"] = time.perf_counter() - memory_start
            if self.config.grpo.self_imitation:
                train = self._self_imitation(train, tables, int(run.step), metrics)
        metrics["time/step_seconds"] = time.perf_counter() - start
        replay = self.next_replay(records, result.samples) if run.replays else None
        return run.next(train, tables, replay), metrics

    def _rollout(self, run: RunState, k: int, tasks: list[rollout.Task]
                 ) -> tuple[rollout.RolloutResult, int]:
        """GRPO step k's rollout of its `tasks`. With dynamic sampling
        (`grpo.min_groups` > 0, DAPO's refill) up to `grpo.max_refills` more batches of fresh
        queries are rolled out while fewer than min_groups node groups have a reward spread,
        so a step still has something to learn once most of the traffic's samples agree.
        Returns the (merged) rollout and the number of refills."""
        g = self.config.grpo
        key = jax.random.fold_in(jax.random.key(self.grpo_seed), 2_000_003 + k)
        memory = (self.memory_view(run, components.rollout_memory_agents(self.config))
                  if self.config.memory.in_rollouts else None)
        roll = lambda tasks, key: rollout.Rollout(self.system, self.tokenizer, self.policy(
            run.train, key), self.parts.rollout, memory).run(tasks)
        result, r = roll(tasks, key), 0
        while g.min_groups and r < g.max_refills and len(
                {s.group for s in self._filter(result.samples)[-1]}) < g.min_groups:
            r += 1
            result = rollout.merge([result, roll(self.refill_tasks(k, r),
                                                 jax.random.fold_in(key, r))])
        return result, r

    def refill_tasks(self, k: int, r: int) -> list[rollout.Task]:
        """Refill r of GRPO step k: `grpo.queries` distinct train queries, seeded by (k, r)."""
        pool = self.grpo_pool
        rng = np.random.default_rng([self.grpo_seed, 11, k, r])
        picks = rng.choice(len(pool), min(self.config.grpo.queries, len(pool)), replace=False)
        return [task_of(suite.decode(self.sources["train"][pool[int(i)]])) for i in picks]

    def _filter(self, samples: list[rollout.Sample]):
        """(fitting, finite, own, informative) samples, each a subset of the one before: see
        `_trainable`."""
        fits = [s for s in samples if len(s.prompt_ids) + len(s.output_ids) <= self.config.max_len]
        finite = [s for s in fits if math.isfinite(s.reward)]  # a bad reward trains nothing
        own = finite
        if self.config.grpo.memory_groups == "drop":  # episodes the policies alone produced
            own = [s for s in finite if not s.uses_memory]
        return fits, finite, own, batching.informative(own)

    def _trainable(self, samples: list[rollout.Sample], metrics: dict) -> list[rollout.Sample]:
        """The samples a GRPO step can learn from: fitting in max_len, a finite reward, not
        touched by the memory (memory_groups="drop"), and in a node group with a reward spread
        (select="agents": one member of every other group too, for the agents' mean group
        variance). Logs the rest."""
        fits, finite, own, spread = self._filter(samples)
        for agent in self.config.agents:  # over all rollout samples, not only the trained ones
            rewards = [s.reward for s in finite if s.agent == agent]
            metrics[f"grpo/reward/{agent}"] = float(np.mean(rewards)) if rewards else 0.0
        trained = spread if self.config.grpo.select == "groups" else (
            batching.for_agent_selection(own))
        metrics.update({"grpo/trained_samples": len(trained),
                        "grpo/dropped_too_long": len(samples) - len(fits),
                        "grpo/nonfinite_rewards": len(fits) - len(finite),
                        "grpo/memory_dropped": len(finite) - len(own),
                        "grpo/memory_member_groups": len({s.group for s in spread
                                                          if s.from_memory}),
                        "grpo/gold_member_groups": len({s.group for s in spread
                                                        if s.from_gold}),
                        "grpo/suffix_samples": sum(s.suffix for s in spread)})
        return trained

    def _update(self, train: ts.TrainState, samples: list[rollout.Sample], metrics: dict
                ) -> ts.TrainState:
        """The jitted all-agents GRPO step on `samples`; logs its per-agent metrics."""
        batch = batching.grpo_batch(samples, self.slots, self.group_sizes, self.offsets,
                                    self.config.max_len, max(self.min_rows, self.config.pad_rows_to),
                                    self.config.pad_to_max_len)
        start = time.perf_counter()
        train, m = jax.block_until_ready(self._run_step("grpo", train, batch))
        metrics["time/update_seconds"] = time.perf_counter() - start
        metrics.update(self._per_agent({g: {k: v for k, v in agent_m.items()
                                            if k != "mean_reward"}
                                        for g, agent_m in m["agents"].items()}, "grpo"))
        metrics.update({f"grpo/{k}": float(m[k]) for k in STEP_COUNTS})
        return train

    def _self_imitation(self, train: ts.TrainState, tables: dict[str, mem.MemoryTable],
                        step: int, metrics: dict) -> ts.TrainState:
        """One SFT step (the GRPO optimizer) on up to `grpo.self_imitation` of each agent's
        best memory entries (`rl/self_imitation.py`), drawn with (seed, step); logs it."""
        host = mem.agent_tables(distributed.to_host(tables), self.slots)
        demos = self_imitation.draw(host, self.config.agents, self.config.grpo.self_imitation,
                                    self.parts.memory.best_reward, self.config.max_len,
                                    np.random.default_rng([self.grpo_seed, 13, step]))
        metrics["self_imitation/rows"] = len(demos)
        if not demos:
            return train
        batch = batching.sft_batch(demos, self.slots, self.group_sizes, self.config.max_len,
                                   self.min_rows, fixed_len=True)  # few shapes to compile
        train, m = self._run_step("self_imitation", train, batch)
        metrics.update(self._per_agent({g: {"loss": a["loss"], "tokens": a["tokens"]}
                                        for g, a in m["agents"].items()}, "self_imitation"))
        metrics["self_imitation/skipped"] = float(m["skipped"])
        return train

    def _per_agent(self, agents: dict, prefix: str) -> dict[str, float]:
        """{group: {metric: [A]}} -> {prefix/metric/agent: float}; mean_reward -> reward."""
        out = {}
        for g, metrics in agents.items():
            for name, values in metrics.items():
                key = "reward" if name == "mean_reward" else name
                for i, agent in enumerate(self.config.groups[g].agents):
                    out[f"{prefix}/{key}/{agent}"] = float(np.asarray(values)[i])
        return out

    def _rollout_metrics(self, result: rollout.RolloutResult, seconds: float) -> dict[str, float]:
        """The rollout's cost counters and training-traffic reward; update metrics at 0 until
        a step runs."""
        c = result.counters
        return {**{f"grpo/{k}": 0.0 for k in STEP_COUNTS},
                "time/update_seconds": 0.0,
                "grpo/accuracy": float(np.mean([r.r_answer for r in result.rewards])),
                "grpo/reward": float(np.mean([r.total for r in result.rewards])),
                "grpo/grounding": _grounding(result),
                "rollout/sampler_calls": c.sampler_calls, "rollout/waves": c.waves,
                "rollout/generated_tokens": c.generated_tokens, "rollout/llm_nodes": c.llm_nodes,
                "rollout/alternatives": c.alternatives, "rollout/shared": c.shared,
                "rollout/tool_calls": c.tool_calls,
                "rollout/memory_hits": c.memory_hits, "rollout/memory_hints": c.memory_hints,
                "rollout/seconds": seconds,
                "rollout/sample_seconds": c.seconds["sample"],
                "rollout/memory_lookup_seconds": c.seconds["memory_lookup"],
                "rollout/tokens_per_second": c.generated_tokens / max(seconds, 1e-9)}

    # -- choosing the iterate (`grpo.select_every`) -------------------------------------------

    def selection_due(self, run: RunState) -> bool:
        """Whether the GRPO step `run` just finished is scored."""
        k, steps = int(run.step) - self.config.sft.steps, self.config.grpo.steps
        return run.selects and selection.due(k, self.config.grpo.select_every, k == steps)

    def select(self, run: RunState) -> tuple[RunState, dict[str, float]]:
        """Scores the policies alone on the selection slice; keeps them when they are the best
        so far. Metrics: their accuracy there and the chosen GRPO step."""
        accuracy = self.evaluate(run, "select", use_memory=False)["eval/select/accuracy"]
        chosen = self._placed(selection.keep(run.selected, run.train, int(run.step), accuracy))
        return run.replace(selected=chosen), {
            "select/accuracy": accuracy,
            "select/chosen_step": float(int(chosen.step) - self.config.sft.steps)}

    def _chose(self, run: RunState) -> bool:
        """Whether `run` ended GRPO with chosen policies."""
        end = self.config.sft.steps + self.config.grpo.steps
        return run.selects and int(run.step) == end and int(run.selected.step) >= 0

    def chosen(self, run: RunState) -> RunState:
        """The run's result: at the end of GRPO with selection on, the chosen policies (the
        memory and all else the last step's); otherwise `run` itself."""
        return run.replace(train=selection.apply(run.train, run.selected)) if self._chose(
            run) else run

    def chosen_step(self, run: RunState) -> int:
        """The run step of the policies `chosen(run)` holds."""
        return int(run.selected.step) if self._chose(run) else int(run.step)

    def with_selection(self, run: RunState, on: bool) -> RunState:
        """A GRPO state with a chosen-iterate node (nothing chosen yet where it had none) or
        without one: a restore builds the checkpoint's tree, then follows the config."""
        if run.phase != "grpo" or run.selects == on:
            return run
        return run.replace(selected=self._placed(selection.start(run.train)) if on
                           else run_state.OFF)

    def _placed(self, chosen: selection.Selected) -> selection.Selected:
        """Its step and accuracy replicated over the mesh, as a multi-process checkpoint saves
        only global arrays (the policies' copies keep the policies' shardings)."""
        return chosen.replace(step=sharding.replicate(chosen.step, self.mesh),
                              accuracy=sharding.replicate(chosen.accuracy, self.mesh))

    # -- evaluation --------------------------------------------------------------------------

    def evaluate(self, run: RunState, split: str, examples: int | None = None,
                 use_memory: bool = True) -> dict[str, float]:
        """Greedy episodes on a split, the run's memory read-only when `use_memory` (and the run
        has one): accuracy per domain, reward parts, cost per query. Changes nothing."""
        return summarize(*self.greedy_episodes(run, split, examples, use_memory), f"eval/{split}")

    def greedy_episodes(self, run: RunState, split: str, examples: int | None = None,
                        use_memory: bool = True
                        ) -> tuple[list[suite.Example], rollout.RolloutResult, float]:
        """What `evaluate` summarizes: the split's first `examples` examples, their greedy
        episodes (each query's rewards in order) and the seconds they took."""
        source = self.sources[split]
        n = len(source) if not examples else min(examples, len(source))
        exs = [suite.decode(source[i]) for i in range(n)]
        start = time.perf_counter()
        engine = rollout.Rollout(self.system, self.tokenizer,
                                 self.policy(run.train, jax.random.key(0), greedy=True),
                                 self.parts.rollout, self.memory_view(run) if use_memory else None)
        result = engine.episodes([task_of(e) for e in exs])
        return exs, result, time.perf_counter() - start


def _grounding(result: rollout.RolloutResult) -> float:
    """The episodes' mean grounded share (what R_G scores), logged whether or not it is weighted."""
    return float(np.mean([t.episode.grounding() for t in result.episodes]))


def summarize(exs: Sequence[suite.Example], result: rollout.RolloutResult, seconds: float,
              prefix: str) -> dict[str, float]:
    """Per-domain accuracy (R_A), mean reward parts, grounding, LLM calls, memory hits, cost per
    query."""
    by_domain = collections.defaultdict(list)
    for ex, parts in zip(exs, result.rewards):
        by_domain[ex.domain].append(float(parts.r_answer))
    n = len(exs)
    out = {f"{prefix}/accuracy/{d}": float(np.mean(v)) for d, v in sorted(by_domain.items())}
    out[f"{prefix}/accuracy"] = float(np.mean([float(p.r_answer) for p in result.rewards]))
    for part in ("r_answer", "r_format", "r_efficiency", "r_grounding", "total"):
        out[f"{prefix}/{part}"] = float(np.mean([float(getattr(p, part)) for p in result.rewards]))
    out[f"{prefix}/grounding"] = _grounding(result)
    calls = [t.episode.llm_calls for t in result.episodes]
    out[f"{prefix}/llm_calls_per_query"] = float(np.mean(calls))
    out[f"{prefix}/memory_hit_rate"] = result.counters.memory_hits / max(
        1, result.counters.memory_hits + sum(calls))
    out[f"{prefix}/tokens_per_query"] = result.counters.generated_tokens / n
    out[f"{prefix}/seconds_per_query"] = seconds / n
    return out
