"""Safe tools: arithmetic, lookups, argument validation, and hostile inputs that must stay inert."""

import ast
import builtins
import contextlib
import math
import pathlib
import socket
import subprocess

import pytest

from joyagents_jax.agents import tools
from joyagents_jax.agents.tools import AGENT_TOOLS, TOOLS, format_number, run_tool
from joyagents_jax.data import world as world_lib
from joyagents_jax.data.world import make_world


@pytest.fixture(scope="module")
def world():
    return make_world(0)


def _calc(world, expression):
    return run_tool("calculator", {"expression": expression}, world)


@pytest.mark.parametrize("expression, expected", [
    ("17 * 4 + 9", "77"), ("(3 + 4) * 5 - 2", "33"), ("9 - (2 + 3)", "4"), ("7 / 2", "3.5"),
    ("12 / 4", "3"), ("2 / 3", "0.6667"), ("2 ** 10", "1024"), ("2 ** -2", "0.25"),
    ("-3 + +5", "2"), ("0.1 + 0.2", "0.3"), ("1e3", "1000"), ("-0.0", "0"),
    ("10 ** 15", "1000000000000000"), ("  (1)  ", "1"),
])
def test_calculator_arithmetic(world, expression, expected):
    assert _calc(world, expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"),
    ("open('/etc/passwd').read()", "only numbers"),
    ("x + 1", "only numbers"),
    ("(1).__class__", "only numbers"),
    ("().__class__.__bases__[0].__subclasses__()", "only numbers"),
    ("abs(-1)", "only numbers"),
    ("lambda: 1", "only numbers"),
    ("[i for i in range(9)]", "only numbers"),
    ("[1, 2][0]", "only numbers"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("1 if 2 else 3", "only numbers"),
    ("1 < 2", "only numbers"),
    ("7 // 2", "only numbers"),
    ("7 % 2", "only numbers"),
    ("(y := 2)", "only numbers"),
    ("9 ** 9 ** 9", "exponent too large"),
    ("2 ** 1000", "exponent too large"),
    ("10 ** 16", "out of range"),
    ("1e308 * 10", "out of range"),
    ("1e-300 ** -64", "out of range"),
    ("9" * 30, "out of range"),
    ("(-8) ** 0.5", "negative"),
    ("1 / 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1 +" * 80 + "1", "too long"),
    ("-" * 150 + "1", "too complex"),
    ("+".join(["1"] * 40), "too complex"),
    ("(" * 99 + "1", "invalid"),
    ("1 +", "invalid"),
    ("", "invalid"),
    ("1\x00", "invalid"),
    ("import os", "invalid"),
])
def test_calculator_rejects_hostile_input(world, expression, message):
    observation = _calc(world, expression)
    assert observation.startswith("error: ") and message in observation, observation
    assert len(observation) < 80


def test_deep_parentheses_are_harmless(world):
    assert _calc(world, "(" * 99 + "1" + ")" * 99) == "1"


@pytest.mark.parametrize("x, digits, expected", [
    (3, 4, "3"), (3.0, 4, "3"), (-0.0, 4, "0"), (1 / 3, 4, "0.3333"), (2.5, 2, "2.5"),
    (7.456, 2, "7.46"), (1e15, 4, "1000000000000000"), (-12.50, 2, "-12.5"),
])
def test_format_number(x, digits, expected):
    assert format_number(x, digits) == expected


def test_kb_search(world):
    name, product = next(iter(world.products.items()))
    observation = run_tool("kb_search", {"query": name.upper()}, world)
    assert observation.splitlines() == [tools.product_fact(world, name)]
    assert f"price {product.price}," in observation and f"maker {product.maker}," in observation
    hits = run_tool("kb_search", {"query": "gold"}, world).splitlines()
    assert 1 <= len(hits) <= tools.MAX_KB_HITS and all("color gold" in h for h in hits)
    assert run_tool("kb_search", {"query": "..."}, world) == "error: empty query"


def _delivered(world):
    return next(o for o in world.orders.values() if o.status == "delivered")


def test_store_tools(world):
    order = _delivered(world)
    line = order.lines[0]
    observation = run_tool("get_order", {"order_id": order.order_id.lower()}, world)
    assert observation.startswith(f"order {order.order_id}: delivered;")
    assert observation.endswith(f"total {order.total}")
    refund = run_tool("return_item", {"order_id": order.order_id, "item": line.product}, world)
    assert refund == f"refund {line.amount} for {line.quantity} {line.product}"
    code, percent = next(iter(world.coupons.items()))
    coupon = run_tool("apply_coupon", {"order_id": order.order_id, "code": code.lower()}, world)
    expected = format_number(order.total * (100 - percent) / 100, 2)
    assert coupon == f"total {expected} after {percent}% off"


def test_store_errors(world):
    pending = next(o for o in world.orders.values() if o.status != "delivered")
    item = pending.lines[0].product
    assert "not delivered" in run_tool("return_item", {"order_id": pending.order_id, "item": item},
                                       world)
    order = _delivered(world)
    assert run_tool("return_item", {"order_id": order.order_id, "item": "zzzzz"}, world) == (
        f"error: order {order.order_id} has no zzzzz")
    assert run_tool("get_order", {"order_id": "Q0"}, world) == "error: no order Q0"
    assert run_tool("apply_coupon", {"order_id": order.order_id, "code": "NOPE"}, world) == (
        "error: no coupon NOPE")


def test_weather_and_units(world):
    city = next(iter(world.weather))
    w = world.weather[city]["friday"]
    assert run_tool("weather", {"city": city.upper(), "day": "Friday"}, world) == (
        f"{city} friday: {w.condition}, {w.temp_c} C")
    assert run_tool("weather", {"city": city, "day": "someday"}, world).startswith("error: day")
    assert run_tool("weather", {"city": "atlantis", "day": "friday"}, world).startswith("error:")

    def conv(value, src, dst):
        return run_tool("convert_units", {"value": value, "from_unit": src, "to_unit": dst}, world)

    assert conv(100, "c", "f") == "100 c = 212 f"
    assert conv(212, "F", "C") == "212 f = 100 c"
    assert conv(0, "c", "k") == "0 c = 273.15 k"
    assert conv(10, "km", "mi") == "10 km = 6.21 mi"
    assert conv(1.5, "kg", "g") == "1.5 kg = 1500 g"
    assert conv(1, "kg", "km") == "error: cannot convert mass to length"
    assert conv(1, "parsec", "km") == "error: unknown unit parsec"
    assert conv(1e300, "km", "m") == "error: number out of range"


@pytest.mark.parametrize("name, args, message", [
    ("calculator", '{"expression": 5}', "error: expression must be a string"),
    ("calculator", '{"expression": "1"', "error: arguments are not valid JSON"),
    ("calculator", "[1, 2]", "error: arguments must be a JSON object"),
    ("calculator", None, "error: arguments must be a JSON object"),
    ("calculator", {}, "error: missing argument expression"),
    ("calculator", {"expression": "1", "x": 1}, "error: unknown argument x"),
    ("calculator", '{"expression": "' + "1" * 600 + '"}', "error: arguments too long"),
    ("calculator", "[" * 250 + "]" * 250, "error: arguments must be a JSON object"),
    ("convert_units", {"value": True, "from_unit": "c", "to_unit": "f"}, "error: value must be"),
    ("convert_units", {"value": "3", "from_unit": "c", "to_unit": "f"}, "error: value must be"),
    ("kb_search", {"query": "a" * 201}, "error: query too long"),
    ("shell", {"cmd": "ls"}, "error: unknown tool shell"),
    ("__import__", {}, "error: unknown tool __import__"),
    (None, {}, "error: unknown tool None"),
])
def test_bad_calls_become_observations(world, name, args, message):
    assert run_tool(name, args, world).startswith(message)


def test_allowed_restricts_tools(world):
    assert run_tool("calculator", {"expression": "1"}, world, allowed=AGENT_TOOLS["qa"]) == (
        "error: unknown tool calculator")
    assert run_tool("calculator", {"expression": "1"}, world, allowed=AGENT_TOOLS["math"]) == "1"
    assert set().union(*AGENT_TOOLS.values()) == set(TOOLS)


_HOSTILE_VALUES = [None, True, 0, -1, 1e308, math.nan, math.inf, "", " ", "../../etc/passwd",
                   "/etc/passwd", "file:///etc/passwd", "http://example.com", "__import__('os')",
                   "$(rm -rf /)", "%s%n", "\x00", "é" * 50, "A" * 199, [], {}, {"a": [1]}]


def test_run_tool_never_raises(world):
    """Every tool, fed hostile values, answers with a string and touches no file, module, socket
    or process: those entry points are replaced by tripwires while the tools run."""
    touched = []

    def tripwire(what):
        def trip(*args, **kwargs):
            touched.append(what)
            raise PermissionError(what)
        return trip

    with contextlib.ExitStack() as stack:
        patch = pytest.MonkeyPatch()
        stack.callback(patch.undo)
        for module, attr in [(builtins, "open"), (builtins, "eval"), (builtins, "exec"),
                             (socket, "socket"), (socket, "create_connection"),
                             (subprocess, "Popen"), (pathlib.Path, "open"),
                             (pathlib.Path, "read_text"), (builtins, "__import__")]:  # last
            patch.setattr(module, attr, tripwire(f"{getattr(module, '__name__', module)}.{attr}"))
        with contextlib.suppress(PermissionError):  # the tripwires work
            open("/etc/hostname")
        control, touched[:] = list(touched), []
        observations = []
        for name, tool in TOOLS.items():
            for value in _HOSTILE_VALUES:
                observations.append(run_tool(name, {k: value for k in tool.params}, world))
                observations.append(run_tool(name, str(value), world))
    assert control == ["builtins.open"]
    assert touched == []
    assert all(isinstance(o, str) and len(o) < 400 for o in observations)


@pytest.mark.parametrize("module", [tools, world_lib])
def test_tool_modules_have_no_escape_hatches(module):
    """Statically: only harmless imports, and no call that runs code or opens anything."""
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    allowed = {"__future__", "ast", "collections.abc", "dataclasses", "json", "math", "operator",
               "random", "re", "string", "types", "typing", "joyagents_jax.data.world"}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= allowed
    forbidden = {"eval", "exec", "compile", "open", "__import__", "getattr", "globals", "vars"}
    called = {n.func.id for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & forbidden
