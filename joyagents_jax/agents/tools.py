"""Safe tools for the sub-agents: pure functions of (arguments, world).

`run_tool` is the one entry point the episode engine needs. It parses and validates the arguments
against the tool's schema, runs the tool, and turns every failure (unknown tool, bad JSON, missing
or extra arguments, wrong types, limits, lookups that miss) into a short `error: ...` observation
that a tiny model can read: a malformed call never raises. Tools read only the `World` they are
given, with no file, network, process or import access; the calculator evaluates a whitelisted
AST and never calls `eval`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import re
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

from joyagents_jax.data.world import DAYS, Order, World

MAX_ARGS_CHARS = 512  # raw JSON arguments
MAX_STRING_CHARS = 200  # any string argument, e.g. a calculator expression
MAX_EXPRESSION_NODES = 64
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15  # largest |number| the calculator and converter handle
MAX_KB_HITS = 3

Number = int | float


_ONLY_ARITHMETIC = "only numbers and + - * / ** ( ) are allowed"


class ToolError(Exception):
    """A failure the calling agent reads as an observation."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool: `fn(world, **args) -> observation` with the argument types it accepts."""

    name: str
    fn: Callable[..., str]
    params: Mapping[str, type]  # argument name -> str or float (any JSON number)
    description: str  # one line, for role prompts

    def signature(self) -> str:
        args = ", ".join(f"{k}: {'number' if t is float else 'string'}"
                         for k, t in self.params.items())
        return f"{self.name}({args}): {self.description}"


def format_number(x: Number, digits: int = 4) -> str:
    """Compact decimal text: integers without '.0', floats rounded to `digits`, no '-0'."""
    if isinstance(x, float):
        x = round(x, digits)
        if x.is_integer():
            x = int(x)
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}".rstrip("0").rstrip(".")


# --- calculator -------------------------------------------------------------------------------


def evaluate(expression: str) -> Number:
    """Value of an arithmetic expression of numbers, + - * / ** and parentheses.

    Raises ToolError for anything else (names, calls, attributes, strings...) and for inputs or
    results beyond the limits, so a hostile expression costs at most a bounded parse.
    """
    if len(expression) > MAX_STRING_CHARS:
        raise ToolError("expression too long")
    if not expression.isascii():
        raise ToolError(_ONLY_ARITHMETIC)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("invalid expression") from None
    if _num_nodes(tree) > MAX_EXPRESSION_NODES:
        raise ToolError("expression too complex")
    return _eval(tree.body)


def _num_nodes(tree: ast.AST) -> int:
    """Size of `tree`; like `ast.walk`, which would import at call time (tools import nothing)."""
    count, todo = 0, [tree]
    while todo:
        count += 1
        todo.extend(ast.iter_child_nodes(todo.pop()))
    return count


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        return _checked(_BINARY_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    raise ToolError(_ONLY_ARITHMETIC)


def _checked(x: Number) -> Number:
    if not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
        raise ToolError("number out of range")
    return x


def _divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise ToolError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError("exponent too large")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    if base < 0 and not float(exponent).is_integer():
        raise ToolError("fractional power of a negative number")
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise ToolError("number out of range")
    return base**exponent


_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.Div: _divide, ast.Pow: _power}


def calculator(world: World, expression: str) -> str:
    del world  # pure arithmetic
    return format_number(evaluate(expression))


# --- knowledge base ---------------------------------------------------------------------------


def product_fact(world: World, name: str) -> str:
    """The knowledge-base line of one product: every attribute the qa questions ask about."""
    p = world.products[name]
    return (f"{p.name}: color {p.color}, price {p.price}, maker {p.maker}, "
            f"weight {p.weight_kg} kg, warranty {p.warranty_years} years")


def kb_search(world: World, query: str) -> str:
    """Products sharing the most words (name, color, maker) with `query`, best first."""
    words = set(re.findall(r"[a-z0-9]+", query.lower()))
    if not words:
        raise ToolError("empty query")
    scored = []
    for rank, p in enumerate(world.products.values()):
        score = len(words & {p.name, p.color, p.maker})
        if score:
            scored.append((-score, rank, p.name))
    if not scored:
        return "no results"
    return "\n".join(product_fact(world, name) for _, _, name in sorted(scored)[:MAX_KB_HITS])


# --- store ------------------------------------------------------------------------------------


def _order(world: World, order_id: str) -> Order:
    order = world.order(order_id)
    if order is None:
        raise ToolError(f"no order {_clip(order_id)}")
    return order


def get_order(world: World, order_id: str) -> str:
    order = _order(world, order_id)
    lines = ", ".join(f"{ln.quantity} {ln.product} at {ln.unit_price}" for ln in order.lines)
    return f"order {order.order_id}: {order.status}; {lines}; total {order.total}"


def return_item(world: World, order_id: str, item: str) -> str:
    order = _order(world, order_id)
    line = order.line(item.strip())
    if line is None:
        raise ToolError(f"order {order.order_id} has no {_clip(item)}")
    if order.status != "delivered":
        raise ToolError(f"order {order.order_id} is {order.status}, not delivered")
    return f"refund {line.amount} for {line.quantity} {line.product}"


def apply_coupon(world: World, order_id: str, code: str) -> str:
    order = _order(world, order_id)
    percent = world.coupons.get(code.strip().upper())
    if percent is None:
        raise ToolError(f"no coupon {_clip(code)}")
    if order.status == "cancelled":
        raise ToolError(f"order {order.order_id} is cancelled")
    return f"total {discounted_total(order.total, percent)} after {percent}% off"


def discounted_total(total: int, percent: int) -> str:
    return format_number(total * (100 - percent) / 100, digits=2)


# --- general ----------------------------------------------------------------------------------


def weather(world: World, city: str, day: str) -> str:
    days = world.weather.get(city.strip().lower())
    if days is None:
        raise ToolError(f"no weather for {_clip(city)}")
    w = days.get(day.strip().lower())
    if w is None:
        raise ToolError(f"day must be one of {', '.join(DAYS)}")
    return f"{city.strip().lower()} {day.strip().lower()}: {w.condition}, {w.temp_c} C"


def convert(world: World, value: Number, from_unit: str, to_unit: str) -> Number:
    """`value` in `from_unit` expressed in `to_unit` (same dimension; affine for temperatures)."""
    src, dst = (world.units.get(u.strip().lower()) for u in (from_unit, to_unit))
    for unit, text in ((src, from_unit), (dst, to_unit)):
        if unit is None:
            raise ToolError(f"unknown unit {_clip(text)}")
    if src.dimension != dst.dimension:
        raise ToolError(f"cannot convert {src.dimension} to {dst.dimension}")
    return _checked(((value * src.scale + src.offset) - dst.offset) / dst.scale)


def convert_units(world: World, value: Number, from_unit: str, to_unit: str) -> str:
    result = convert(world, _checked(value), from_unit, to_unit)
    src, dst = from_unit.strip().lower(), to_unit.strip().lower()
    return f"{format_number(value, 2)} {src} = {format_number(result, 2)} {dst}"


# --- registry ---------------------------------------------------------------------------------

TOOLS: Mapping[str, Tool] = MappingProxyType({t.name: t for t in (
    Tool("calculator", calculator, {"expression": str},
         "evaluate numbers with + - * / ** and parentheses"),
    Tool("kb_search", kb_search, {"query": str}, "search the product knowledge base"),
    Tool("get_order", get_order, {"order_id": str}, "status, items and total of an order"),
    Tool("return_item", return_item, {"order_id": str, "item": str},
         "return an item of a delivered order; gives the refund"),
    Tool("apply_coupon", apply_coupon, {"order_id": str, "code": str},
         "order total after a coupon"),
    Tool("weather", weather, {"city": str, "day": str}, "weather of a city on a weekday"),
    Tool("convert_units", convert_units, {"value": float, "from_unit": str, "to_unit": str},
         "convert length, mass, volume or temperature"),
)})

AGENT_TOOLS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "qa": ("kb_search",),
    "efc": ("get_order", "return_item", "apply_coupon"),
    "gfc": ("weather", "convert_units"),
    "math": ("calculator",),
})


def run_tool(name: str, args: Mapping[str, Any] | str, world: World,
             allowed: Collection[str] | None = None) -> str:
    """The observation of calling tool `name` with `args` (a mapping or its JSON text).

    `allowed` restricts the callable tools (an agent's tool set). Never raises: every failure
    becomes `error: ...`.
    """
    try:
        tool = TOOLS.get(name) if isinstance(name, str) else None
        if tool is None or (allowed is not None and name not in allowed):
            raise ToolError(f"unknown tool {_clip(str(name))}")
        return tool.fn(world, **_validated(tool, _parsed(args)))
    except ToolError as e:
        return f"error: {e}"
    except Exception:  # noqa: BLE001 - a tool bug must not end an episode either
        return "error: tool failed"


def _parsed(args: Mapping[str, Any] | str) -> Any:
    if not isinstance(args, str):
        return args
    if len(args) > MAX_ARGS_CHARS:
        raise ToolError("arguments too long")
    try:
        return json.loads(args)
    except (ValueError, RecursionError):
        raise ToolError("arguments are not valid JSON") from None


def _validated(tool: Tool, args: Any) -> dict[str, Any]:
    if not isinstance(args, Mapping):
        raise ToolError("arguments must be a JSON object")
    for key in args:
        if key not in tool.params:
            raise ToolError(f"unknown argument {_clip(str(key))}")
    for key, kind in tool.params.items():
        if key not in args:
            raise ToolError(f"missing argument {key}")
        value = args[key]
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ToolError(f"{key} must be a number")
        if kind is str and not isinstance(value, str):
            raise ToolError(f"{key} must be a string")
        if kind is str and len(value) > MAX_STRING_CHARS:
            raise ToolError(f"{key} too long")
    return dict(args)


def _clip(text: str, limit: int = 24) -> str:
    """User-supplied text echoed in an error, cut short so observations stay small."""
    return text if len(text) <= limit else text[:limit] + "..."
