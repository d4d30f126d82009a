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
import operator
import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from joyagents_jax.agents.tools import convert, discounted_total, format_number, run_tool
from joyagents_jax.data.world import DAYS, Order, OrderLine, World, make_world

MASTER = "master"
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


# --- gold trajectories ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Step:
    """A sub-agent's share of a task: it answers `query`, after one tool call when `tool` is set."""

    agent: str
    query: str
    answer: str
    kind: str
    tool: str | None = None
    args: Mapping[str, Any] | None = None

    def nodes(self, world: World) -> list[dict[str, str]]:
        nodes = []
        if self.tool is not None:
            args = json.dumps(self.args, separators=(",", ":"))
            nodes.append({"agent": self.agent, "output": f'<tool name="{self.tool}">{args}</tool>',
                          "observation": run_tool(self.tool, self.args, world)})
        return nodes + [_answer(self.agent, self.answer)]


@dataclasses.dataclass(frozen=True)
class _Task:
    query: str
    answer: str
    kind: str
    gold: tuple[dict[str, str], ...]
    sub_queries: tuple[str, ...] = ()  # questions the master asks sub-agents explicitly


def _answer(agent: str, text: str) -> dict[str, str]:
    return {"agent": agent, "output": f"<answer>{text}</answer>"}


def _single(world: World, step: _Step) -> _Task:
    """The master forwards the user query unchanged, then repeats the sub-agent's answer."""
    gold = [{"agent": MASTER, "output": f'<call agent="{step.agent}"/>'}, *step.nodes(world),
            _answer(MASTER, step.answer)]
    return _Task(step.query, step.answer, step.kind, tuple(gold))


def _chain(world: World, query: str, first: _Step, second: _Step) -> _Task:
    """Two sub-agents in turn, asked explicit sub-queries; the second uses the first answer."""
    gold = []
    for step in (first, second):
        gold += [{"agent": MASTER, "output": f'<call agent="{step.agent}">{step.query}</call>'},
                 *step.nodes(world)]
    gold.append(_answer(MASTER, second.answer))
    return _Task(query, second.answer, second.kind, tuple(gold), (first.query, second.query))


# --- math -------------------------------------------------------------------------------------

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
_ITEMS = ("pens", "cards", "eggs", "coins", "books", "shells", "stamps", "apples", "beads", "cups")


@dataclasses.dataclass(frozen=True)
class _Expr:
    """Expression text with its integer value and the precedence of its top operator."""

    text: str
    value: int
    precedence: int = 3  # a number


def _apply(left: _Expr, op: str, right: _Expr) -> _Expr:
    """`left op right` with just the parentheses it needs."""
    p = _PRECEDENCE[op]
    wrap_right = right.precedence < p or (right.precedence == p and op in "-/")
    lhs = f"({left.text})" if left.precedence < p else left.text
    rhs = f"({right.text})" if wrap_right else right.text
    return _Expr(f"{lhs} {op} {rhs}", _OPS[op](left.value, right.value), p)


def _num(n: int) -> _Expr:
    return _Expr(str(n), n)


def _draw(rng: random.Random, ops: str, value: int, hi: int) -> tuple[str, int]:
    """An operator of `ops` and an operand that keep the running value a positive integer."""
    while True:
        op = rng.choice(ops)
        if op == "-" and value > 1:
            return op, rng.randint(1, min(hi, value - 1))
        if op == "/":
            divisors = [d for d in range(2, hi + 1) if value % d == 0 and value > d]
            if divisors:
                return op, rng.choice(divisors)
        if op in "+*":
            return op, rng.randint(2, hi)


def _calculation(expr: _Expr) -> _Step:
    return _Step("math", f"What is {expr.text}?", format_number(expr.value), "number",
                 "calculator", {"expression": expr.text})


def _expression(rng: random.Random, steps: int, hi: int) -> _Step:
    expr = _num(rng.randint(2, hi))
    for _ in range(steps):
        op, n = _draw(rng, "+-*/", expr.value, hi)
        swap = op in "+*" and rng.random() < 0.5
        expr = _apply(_num(n), op, expr) if swap else _apply(expr, op, _num(n))
    return _calculation(expr)


def _word_problem(rng: random.Random, world: World, steps: int, hi: int) -> _Step:
    """A short story whose count changes `steps` times; solved with one calculator call."""
    who, items = rng.choice(world.people), rng.choice(_ITEMS)
    a = rng.randint(2, hi)
    expr = _num(a)
    if rng.random() < 0.5:
        b = rng.randint(2, hi)
        expr = _apply(expr, "*", _num(b))
        sentences, steps = [f"{who} has {a} boxes of {b} {items}."], steps - 1
    else:
        sentences = [f"{who} has {a} {items}."]
    question = f"How many {items} does {who} have?"
    for i in range(steps):
        last = i == steps - 1
        op, n = _draw(rng, "+-*/" if last else "+-*", expr.value, hi)
        if op == "*":  # a story multiplies by 2 or 3 only
            n = rng.choice((2, 3))
            sentences.append(f"The {items} {'double' if n == 2 else 'triple'}.")
        elif op == "/":
            sentences.append(f"{who} shares them equally among {n} kids.")
            question = "How many does each kid get?"
        else:
            sentences.append(f"{who} {rng.choice(_MORE if op == '+' else _LESS)} {n}.")
        expr = _apply(expr, op, _num(n))
    step = _calculation(expr)
    return dataclasses.replace(step, query=" ".join(sentences + [question]))


_MORE = ("gets", "finds", "buys")
_LESS = ("gives away", "loses", "sells")


def _math_task(rng: random.Random, world: World, config: SuiteConfig) -> _Task:
    steps = rng.randint(*config.math_steps)
    if rng.random() < config.math_word_fraction:
        return _single(world, _word_problem(rng, world, steps, config.max_operand))
    return _single(world, _expression(rng, steps, config.max_operand))


# --- qa ---------------------------------------------------------------------------------------

_QA_QUESTIONS = {  # product attribute -> (question template, answer kind)
    "price": ("How much does the {} cost?", "number"),
    "color": ("What color is the {}?", "text"),
    "maker": ("Who makes the {}?", "text"),
    "weight_kg": ("How many kg does the {} weigh?", "number"),
    "warranty_years": ("How many years is the {} warranty?", "number"),
}


def _qa(world: World, name: str, attribute: str) -> _Step:
    template, kind = _QA_QUESTIONS[attribute]
    answer = str(getattr(world.products[name], attribute))
    return _Step("qa", template.format(name), answer, kind, "kb_search", {"query": name})


def _qa_task(rng: random.Random, world: World, config: SuiteConfig) -> _Task:
    del config
    name = rng.choice(tuple(world.products))
    return _single(world, _qa(world, name, rng.choice(tuple(_QA_QUESTIONS))))


# --- efc --------------------------------------------------------------------------------------


def _order_step(order: Order, query: str, answer: Any, kind: str) -> _Step:
    return _Step("efc", query, str(answer), kind, "get_order", {"order_id": order.order_id})


def _call(name: str, **arguments: str) -> str:
    """A function call as the answer: compact JSON checked structurally by the reward."""
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))


def _efc_steps(world: World, order: Order, line: OrderLine, code: str) -> list[_Step]:
    """Every efc question about `order` (one of its lines, one coupon) that has an answer."""
    oid, item = order.order_id, line.product
    steps = [
        _order_step(order, f"What is the status of order {oid}?", order.status, "text"),
        _order_step(order, f"What is the total of order {oid}?", order.total, "number"),
        _order_step(order, f"How many {item} are in order {oid}?", line.quantity, "number"),
    ]
    if order.status == "delivered":
        args = {"order_id": oid, "item": item}
        steps += [_Step("efc", f"What refund do I get for the {item} in order {oid}?",
                        str(line.amount), "number", "return_item", args),
                  _Step("efc", f"Return the {item} from order {oid}.",
                        _call("return_item", **args), "call")]
    if order.status != "cancelled":
        args = {"order_id": oid, "code": code}
        total = discounted_total(order.total, world.coupons[code])
        steps += [_Step("efc", f"What is order {oid}'s total with coupon {code}?", total,
                        "number", "apply_coupon", args),
                  _Step("efc", f"Apply coupon {code} to order {oid}.",
                        _call("apply_coupon", **args), "call")]
    return steps


def _efc_task(rng: random.Random, world: World, config: SuiteConfig) -> _Task:
    order = rng.choice(tuple(world.orders.values()))
    line, code = rng.choice(order.lines), rng.choice(tuple(world.coupons))
    steps = _efc_steps(world, order, line, code)
    calls = [s for s in steps if s.kind == "call"]
    if calls and rng.random() < config.efc_call_fraction:
        return _single(world, rng.choice(calls))
    return _single(world, rng.choice([s for s in steps if s.kind != "call"]))


# --- gfc --------------------------------------------------------------------------------------

_CONVERSIONS = {  # (from, to) -> range of whole values asked about
    ("km", "mi"): (1, 100), ("mi", "km"): (1, 100), ("kg", "lb"): (1, 100),
    ("lb", "kg"): (1, 100), ("m", "ft"): (1, 100), ("ft", "m"): (1, 100),
    ("cm", "in"): (1, 100), ("in", "cm"): (1, 100), ("l", "gal"): (1, 100),
    ("gal", "l"): (1, 100), ("g", "oz"): (10, 500), ("c", "f"): (-10, 40), ("f", "c"): (0, 100),
}


def _conversion(world: World, value: int, src: str, dst: str) -> _Step:
    answer = format_number(convert(world, value, src, dst), digits=2)
    return _Step("gfc", f"Convert {value} {src} to {dst}.", answer, "number", "convert_units",
                 {"value": value, "from_unit": src, "to_unit": dst})


def _gfc_task(rng: random.Random, world: World, config: SuiteConfig) -> _Task:
    del config
    kind = rng.choice(("condition", "temperature", "conversion"))
    if kind == "conversion":
        src, dst = rng.choice(tuple(_CONVERSIONS))
        return _single(world, _conversion(world, rng.randint(*_CONVERSIONS[src, dst]), src, dst))
    city, day = rng.choice(tuple(world.weather)), rng.choice(DAYS)
    w, args = world.weather[city][day], {"city": city, "day": day}
    if kind == "condition":
        step = _Step("gfc", f"What is the weather in {city} on {day}?", w.condition, "text",
                     "weather", args)
    else:
        step = _Step("gfc", f"What is the temperature in {city} on {day}?", str(w.temp_c),
                     "number", "weather", args)
    return _single(world, step)


# --- cooperation ------------------------------------------------------------------------------


def _cooperation_task(rng: random.Random, world: World, config: SuiteConfig) -> _Task:
    del config
    kind = rng.choice(("cost", "change", "pounds"))
    if kind == "change":
        order = rng.choice(tuple(world.orders.values()))
        paid = (order.total // 50 + 1) * 50
        first = _order_step(order, f"What is the total of order {order.order_id}?", order.total,
                            "number")
        second = _calculation(_apply(_num(paid), "-", _num(order.total)))
        return _chain(world, f"I pay {paid} for order {order.order_id}. What is my change?",
                      first, second)
    product = rng.choice(tuple(world.products.values()))
    if kind == "cost":
        n = rng.randint(2, 9)
        second = _calculation(_apply(_num(n), "*", _num(product.price)))
        return _chain(world, f"What do {n} of the {product.name} cost?",
                      _qa(world, product.name, "price"), second)
    return _chain(world, f"How many lb does the {product.name} weigh?",
                  _qa(world, product.name, "weight_kg"),
                  _conversion(world, product.weight_kg, "kg", "lb"))


_TASKS: Mapping[str, Callable[[random.Random, World, SuiteConfig], _Task]] = {
    "math": _math_task, "qa": _qa_task, "efc": _efc_task, "gfc": _gfc_task,
    "cooperation": _cooperation_task,
}


# --- pools and traffic ------------------------------------------------------------------------


def _pool(domain: str, world: World, config: SuiteConfig) -> list[_Task]:
    """`questions_per_domain` tasks with distinct queries, in random (popularity) order."""
    rng = random.Random(f"{config.seed}/{domain}")
    tasks, seen = [], set()
    for _ in range(50 * config.questions_per_domain):
        task = _TASKS[domain](rng, world, config)
        if task.query not in seen:
            seen.add(task.query)
            tasks.append(task)
            if len(tasks) == config.questions_per_domain:
                return tasks
    raise ValueError(f"the world has fewer than {config.questions_per_domain} distinct {domain} "
                     "questions; enlarge it or lower questions_per_domain")


def _record(domain: str, index: int, task: _Task) -> dict[str, Any]:
    return {"query": task.query, "domain": domain, "answer": task.answer,
            "answer_kind": task.kind, "min_llm_calls": len(task.gold),
            "question_id": f"{domain}-{index:04d}", "gold": json.dumps(task.gold)}


def _hold_out(domain: str, tasks: list[_Task], n: int,
              reserved: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records of the popular part and of the `n` held-out questions of a pool.

    Held-out questions are the last ones whose query no other task asks a sub-agent, so a
    `test_novel` question never occurs in train, not even as a cooperation sub-query.
    """
    novel = [i for i in reversed(range(len(tasks))) if tasks[i].query not in reserved][:n]
    if len(novel) < n:
        raise ValueError(f"too few {domain} questions to hold out {n}; raise questions_per_domain")
    records = [_record(domain, i, task) for i, task in enumerate(tasks)]
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
    reserved = {q for tasks in pools.values() for t in tasks for q in t.sub_queries}
    popular, novel = {}, {}
    for domain, tasks in pools.items():
        popular[domain], novel[domain] = _hold_out(domain, tasks, config.held_out_per_domain,
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
        return tfds.core.DatasetInfo(builder=self, description=__doc__,
                                     features=tfds.features.FeaturesDict(features),
                                     disable_shuffling=True)

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
