"""The assistant suite's tasks: per domain, a seeded draw of a question and its gold trajectory.

A `Task` holds the user query, the answer and its kind, and the gold nodes in order (each LLM
node's output, with the observation a tool node produces on the world). `TASKS[domain](rng,
world, config)` draws one task of a domain; `assistant_suite` turns pools of them into splits.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from joyagents_jax.agents.tools import convert, discounted_total, format_number, run_tool
from joyagents_jax.data.world import DAYS, Order, OrderLine, World

if TYPE_CHECKING:  # the suite's config module imports this one
    from joyagents_jax.data.assistant_suite import SuiteConfig

MASTER = "master"


# --- gold trajectories ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
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
class Task:
    query: str
    answer: str
    kind: str
    gold: tuple[dict[str, str], ...]
    sub_queries: tuple[str, ...] = ()  # questions the master asks sub-agents explicitly


def _answer(agent: str, text: str) -> dict[str, str]:
    return {"agent": agent, "output": f"<answer>{text}</answer>"}


def _single(world: World, step: Step) -> Task:
    """The master forwards the user query unchanged, then repeats the sub-agent's answer."""
    gold = [{"agent": MASTER, "output": f'<call agent="{step.agent}"/>'}, *step.nodes(world),
            _answer(MASTER, step.answer)]
    return Task(step.query, step.answer, step.kind, tuple(gold))


def _chain(world: World, query: str, first: Step, second: Step) -> Task:
    """Two sub-agents in turn, asked explicit sub-queries; the second uses the first answer."""
    gold = []
    for step in (first, second):
        gold += [{"agent": MASTER, "output": f'<call agent="{step.agent}">{step.query}</call>'},
                 *step.nodes(world)]
    gold.append(_answer(MASTER, second.answer))
    return Task(query, second.answer, second.kind, tuple(gold), (first.query, second.query))


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


def _calculation(expr: _Expr) -> Step:
    return Step("math", f"What is {expr.text}?", format_number(expr.value), "number",
                 "calculator", {"expression": expr.text})


def _expression(rng: random.Random, steps: int, hi: int) -> Step:
    expr = _num(rng.randint(2, hi))
    for _ in range(steps):
        op, n = _draw(rng, "+-*/", expr.value, hi)
        swap = op in "+*" and rng.random() < 0.5
        expr = _apply(_num(n), op, expr) if swap else _apply(expr, op, _num(n))
    return _calculation(expr)


def _word_problem(rng: random.Random, world: World, steps: int, hi: int) -> Step:
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


def _math_task(rng: random.Random, world: World, config: SuiteConfig) -> Task:
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


def _qa(world: World, name: str, attribute: str) -> Step:
    template, kind = _QA_QUESTIONS[attribute]
    answer = str(getattr(world.products[name], attribute))
    return Step("qa", template.format(name), answer, kind, "kb_search", {"query": name})


def _qa_task(rng: random.Random, world: World, config: SuiteConfig) -> Task:
    del config
    name = rng.choice(tuple(world.products))
    return _single(world, _qa(world, name, rng.choice(tuple(_QA_QUESTIONS))))


# --- efc --------------------------------------------------------------------------------------


def _order_step(order: Order, query: str, answer: Any, kind: str) -> Step:
    return Step("efc", query, str(answer), kind, "get_order", {"order_id": order.order_id})


def _call(name: str, **arguments: str) -> str:
    """A function call as the answer: compact JSON checked structurally by the reward."""
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))


def _efc_steps(world: World, order: Order, line: OrderLine, code: str) -> list[Step]:
    """Every efc question about `order` (one of its lines, one coupon) that has an answer."""
    oid, item = order.order_id, line.product
    steps = [
        _order_step(order, f"What is the status of order {oid}?", order.status, "text"),
        _order_step(order, f"What is the total of order {oid}?", order.total, "number"),
        _order_step(order, f"How many {item} are in order {oid}?", line.quantity, "number"),
    ]
    if order.status == "delivered":
        args = {"order_id": oid, "item": item}
        steps += [Step("efc", f"What refund do I get for the {item} in order {oid}?",
                        str(line.amount), "number", "return_item", args),
                  Step("efc", f"Return the {item} from order {oid}.",
                        _call("return_item", **args), "call")]
    if order.status != "cancelled":
        args = {"order_id": oid, "code": code}
        total = discounted_total(order.total, world.coupons[code])
        steps += [Step("efc", f"What is order {oid}'s total with coupon {code}?", total,
                        "number", "apply_coupon", args),
                  Step("efc", f"Apply coupon {code} to order {oid}.",
                        _call("apply_coupon", **args), "call")]
    return steps


def _efc_task(rng: random.Random, world: World, config: SuiteConfig) -> Task:
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


def _conversion(world: World, value: int, src: str, dst: str) -> Step:
    answer = format_number(convert(world, value, src, dst), digits=2)
    return Step("gfc", f"Convert {value} {src} to {dst}.", answer, "number", "convert_units",
                 {"value": value, "from_unit": src, "to_unit": dst})


def _gfc_task(rng: random.Random, world: World, config: SuiteConfig) -> Task:
    del config
    kind = rng.choice(("condition", "temperature", "conversion"))
    if kind == "conversion":
        src, dst = rng.choice(tuple(_CONVERSIONS))
        return _single(world, _conversion(world, rng.randint(*_CONVERSIONS[src, dst]), src, dst))
    city, day = rng.choice(tuple(world.weather)), rng.choice(DAYS)
    w, args = world.weather[city][day], {"city": city, "day": day}
    if kind == "condition":
        step = Step("gfc", f"What is the weather in {city} on {day}?", w.condition, "text",
                     "weather", args)
    else:
        step = Step("gfc", f"What is the temperature in {city} on {day}?", str(w.temp_c),
                     "number", "weather", args)
    return _single(world, step)


# --- cooperation ------------------------------------------------------------------------------


def _cooperation_task(rng: random.Random, world: World, config: SuiteConfig) -> Task:
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


TASKS: Mapping[str, Callable[[random.Random, World, SuiteConfig], Task]] = {
    "math": _math_task, "qa": _qa_task, "efc": _efc_task, "gfc": _gfc_task,
    "cooperation": _cooperation_task,
}
