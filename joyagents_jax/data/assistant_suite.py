"""The assistant task suite: a procedural, seeded tfds dataset of multi-agent tasks.

Five domains over one synthetic `World`: `math` (expressions and word problems, calculator), `qa`
(product knowledge base), `efc` (orders, returns, coupons), `gfc` (weather, unit conversion) and
`cooperation` (two sub-agents in turn: the master passes the first one's answer to the second in an
explicit sub-query). Each domain has a pool of distinct questions in random popularity order;
traffic draws from it with Zipf weights, so popular questions recur, and train / validation / test
are consecutive slices of that traffic. A held-out part of each pool feeds `test_novel`, whose
questions never occur in train.

Every example carries its gold trajectory: each LLM node's output, in order, with the observation
each tool node produces on the world, so an engine can replay it. Queries and outputs are short
and every answer is copied from an observation (tiny byte-level models copy well). `load_suite`
builds array_record files once and reads them with `tfds.data_source` (no TensorFlow).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from joyagents_jax.data import tasks, tfds_local
from joyagents_jax.data.world import World, make_world

MASTER = tasks.MASTER
DOMAINS = ("math", "qa", "efc", "gfc", "cooperation")
SPLITS = ("train", "validation", "test", "test_novel")
ANSWER_KINDS = ("text", "number", "call")


@dataclasses.dataclass(eq=False, kw_only=True)
class SuiteConfig(tfds.core.BuilderConfig):
    """Everything one build depends on: world, question pools, traffic and difficulty."""

    seed: int = 0  # question pools and traffic
    world_seed: int = 0
    num_products: int = 64
    num_orders: int = 48
    num_cities: int = 12
    questions_per_domain: int = 300  # distinct questions in each domain's pool
    novel_fraction: float = 0.2  # share of each pool held out of traffic, for test_novel
    zipf_exponent: float = 1.0  # popularity of the question at rank r is proportional to r**-s
    domain_weights: tuple[tuple[str, float], ...] = tuple((d, 1.0) for d in DOMAINS)
    math_steps: tuple[int, int] = (1, 2)  # min, max arithmetic operations per math question
    math_word_fraction: float = 0.5  # word problems; the rest are bare expressions
    max_operand: int = 20
    efc_call_fraction: float = 0.3  # efc requests answered with a function call (when possible)
    num_train: int = 2000
    num_validation: int = 200
    num_test: int = 200
    num_test_novel: int = 200

    def __post_init__(self):
        unknown = {d for d, _ in self.domain_weights} - set(DOMAINS)
        if unknown:
            raise ValueError(f"unknown domains {sorted(unknown)}; expected some of {DOMAINS}")
        if not 1 <= self.math_steps[0] <= self.math_steps[1]:
            raise ValueError(f"math_steps must be (min, max), 1 <= min <= max: {self.math_steps}")
        if not 0 < self.novel_fraction < 1:
            raise ValueError(f"novel_fraction must be in (0, 1): {self.novel_fraction}")
        if self.num_test_novel > len(self.domain_weights) * self.held_out_per_domain:
            raise ValueError("num_test_novel exceeds the held-out questions; raise "
                             "questions_per_domain or novel_fraction")

    @property
    def held_out_per_domain(self) -> int:
        return round(self.novel_fraction * self.questions_per_domain)


TINY = SuiteConfig(name="tiny", description="CPU default: small world, builds in about a second.")
BASE = SuiteConfig(name="base", description="Larger world and pools, up to 3 arithmetic steps.",
                   num_products=320, num_orders=192, num_cities=32, questions_per_domain=1000,
                   math_steps=(1, 3), max_operand=30, num_train=50_000, num_validation=1000,
                   num_test=1000, num_test_novel=1000)
# The embedded CPU default trains five ~0.1M-parameter agents in minutes: a small world and small
# question pools, so popular questions recur often (memorizable) while test_novel still needs
# copying from observations; one arithmetic step.
CPU = SuiteConfig(name="cpu", description="Embedded CPU default: small world and pools.",
                  num_products=24, num_orders=16, num_cities=6, questions_per_domain=60,
                  math_steps=(1, 1), max_operand=12, num_test_novel=50)
CONFIGS: Mapping[str, SuiteConfig] = {c.name: c for c in (TINY, CPU, BASE)}


@dataclasses.dataclass(frozen=True)
class GoldNode:
    """One LLM node of a gold trajectory; `observation` is set on tool nodes only."""

    agent: str
    output: str
    observation: str | None = None


@dataclasses.dataclass(frozen=True)
class Example:
    """A decoded suite record."""

    query: str
    domain: str
    answer: str
    answer_kind: str  # text | number | call
    min_llm_calls: int  # LLM nodes of the gold trajectory
    question_id: str  # identity of the underlying question (popularity, novelty)
    gold: tuple[GoldNode, ...]


def decode(record: Mapping[str, Any]) -> Example:
    """The `Example` of a record read from a data source (bytes and numpy scalars)."""
    text = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in record.items()}
    gold = tuple(GoldNode(**node) for node in json.loads(text["gold"]))
    return Example(query=text["query"], domain=text["domain"], answer=text["answer"],
                   answer_kind=text["answer_kind"], min_llm_calls=int(record["min_llm_calls"]),
                   question_id=text["question_id"], gold=gold)


# --- pools and traffic ------------------------------------------------------------------------


def _pool(domain: str, world: World, config: SuiteConfig) -> list[tasks.Task]:
    """`questions_per_domain` tasks with distinct queries, in random (popularity) order."""
    rng = random.Random(f"{config.seed}/{domain}")
    pool, seen = [], set()
    for _ in range(50 * config.questions_per_domain):
        task = tasks.TASKS[domain](rng, world, config)
        if task.query not in seen:
            seen.add(task.query)
            pool.append(task)
            if len(pool) == config.questions_per_domain:
                return pool
    raise ValueError(f"the world has fewer than {config.questions_per_domain} distinct {domain} "
                     "questions; enlarge it or lower questions_per_domain")


def _record(domain: str, index: int, task: tasks.Task) -> dict[str, Any]:
    return {"query": task.query, "domain": domain, "answer": task.answer,
            "answer_kind": task.kind, "min_llm_calls": len(task.gold),
            "question_id": f"{domain}-{index:04d}", "gold": json.dumps(task.gold)}


def _hold_out(domain: str, pool: list[tasks.Task], n: int,
              reserved: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records of the popular part and of the `n` held-out questions of a pool.

    Held-out questions are the last ones whose query no other task asks a sub-agent, so a
    `test_novel` question never occurs in train, not even as a cooperation sub-query.
    """
    novel = [i for i in reversed(range(len(pool))) if pool[i].query not in reserved][:n]
    if len(novel) < n:
        raise ValueError(f"too few {domain} questions to hold out {n}; raise questions_per_domain")
    records = [_record(domain, i, task) for i, task in enumerate(pool)]
    held = set(novel)
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def suite_world(config: SuiteConfig | str) -> World:
    """The world a suite's tools run on: episodes of this suite must use it."""
    config = CONFIGS[config] if isinstance(config, str) else config
    return make_world(config.world_seed, num_products=config.num_products,
                      num_orders=config.num_orders, num_cities=config.num_cities)


def generate_splits(config: SuiteConfig) -> dict[str, list[dict[str, Any]]]:
    """All records of every split, as the builder writes them. Deterministic in `config`."""
    world = suite_world(config)
    domains = [d for d, _ in config.domain_weights]
    weights = [w for _, w in config.domain_weights]
    pools = {d: _pool(d, world, config) for d in domains}
    reserved = {q for pool in pools.values() for t in pool for q in t.sub_queries}
    popular, novel = {}, {}
    for domain, pool in pools.items():
        popular[domain], novel[domain] = _hold_out(domain, pool, config.held_out_per_domain,
                                                   reserved)

    rng = random.Random(f"{config.seed}/traffic")
    ranks = range(1, config.questions_per_domain - config.held_out_per_domain + 1)
    zipf = list(itertools.accumulate(r**-config.zipf_exponent for r in ranks))
    sizes = (config.num_train, config.num_validation, config.num_test)
    traffic = [rng.choices(popular[d], cum_weights=zipf)[0]
               for d in rng.choices(domains, weights, k=sum(sizes))]
    splits, start = {}, 0
    for name, size in zip(SPLITS, sizes):
        splits[name], start = traffic[start:start + size], start + size
    splits["test_novel"] = _novel_draws(rng, novel, weights, config.num_test_novel)
    return splits


def _novel_draws(rng: random.Random, novel: Mapping[str, list[dict[str, Any]]],
                 weights: Sequence[float], n: int) -> list[dict[str, Any]]:
    """`n` distinct held-out questions, domains drawn by weight until each pool runs out."""
    remaining = {d: list(records) for d, records in novel.items()}
    drawn = []
    while len(drawn) < n:
        open_domains = [(d, w) for d, w in zip(remaining, weights) if remaining[d]]
        domain = rng.choices([d for d, _ in open_domains], [w for _, w in open_domains])[0]
        drawn.append(remaining[domain].pop(0))
    return drawn


# --- tfds -------------------------------------------------------------------------------------


class AssistantSuite(tfds.core.GeneratorBasedBuilder):
    """tfds builder of the suite; read it with `load_suite` (array_record, no TensorFlow)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = list(CONFIGS.values())
    DEFAULT_CONFIG_NAME = "tiny"

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        features = {k: text for k in ("query", "domain", "answer", "answer_kind", "question_id",
                                      "gold")}
        features["min_llm_calls"] = tfds.features.Scalar(dtype=np.int32)
        return tfds_local.built_here(tfds.core.DatasetInfo(
            builder=self, description=__doc__, features=tfds.features.FeaturesDict(features),
            disable_shuffling=True))

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        del dl_manager  # procedural: nothing to download
        return {name: self._generate_examples(records)
                for name, records in generate_splits(self.builder_config).items()}

    def _generate_examples(self, records: list[dict[str, Any]]):
        yield from enumerate(records)


def fingerprint(config: SuiteConfig) -> str:
    """A short hash of the fields that determine a build (not its name or description)."""
    base = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in base}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


def _storable(config: SuiteConfig | str) -> SuiteConfig | str:
    """Give a config that differs from the registered one of its name its own directory."""
    if isinstance(config, str):
        return config
    registered = CONFIGS.get(config.name)
    if registered is not None and fingerprint(registered) == fingerprint(config):
        return config
    return dataclasses.replace(config, name=f"{config.name}_{fingerprint(config)}")


def load_suite(config: SuiteConfig | str = "tiny",
               data_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Random-access data sources of every split; builds the suite under `data_dir` if needed.

    Records are dicts of bytes and numpy scalars; `decode(record)` gives an `Example`.
    """
    builder = AssistantSuite(config=_storable(config), data_dir=data_dir,
                             file_format="array_record")
    tfds.disable_progress_bar()  # the build takes a second; its bars would drown the train log
    builder.download_and_prepare()
    return builder.as_data_source()
