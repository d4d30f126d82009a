"""The synthetic world: deterministic per seed (in and across processes), small and consistent."""

import os
import re
import subprocess
import sys
import time

from joyagents_jax.data.world import COLORS, DAYS, STATUSES, UNITS, make_world

_DIGEST = "import hashlib; from joyagents_jax.data.world import make_world; " \
          "print(hashlib.sha256(repr(make_world(7)).encode()).hexdigest())"


def test_same_seed_same_world():
    assert make_world(3) == make_world(3)
    assert make_world(3) != make_world(4)
    assert repr(make_world(3, num_products=10)) == repr(make_world(3, num_products=10))


def test_identical_across_processes():
    """Hash randomization must not leak in: two interpreters with different hash seeds agree."""
    digests = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True,
                             text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_builds_in_milliseconds():
    start = time.perf_counter()
    make_world(0)
    assert time.perf_counter() - start < 0.5


def test_sizes_and_random_names():
    world = make_world(0, num_products=30, num_orders=20, num_cities=5)
    assert (len(world.products), len(world.orders), len(world.weather)) == (30, 20, 5)
    names = [*world.products, *world.makers, *world.weather, *(p.lower() for p in world.people)]
    assert len(set(names)) == len(names)  # no name means two things
    assert all(re.fullmatch(r"([bdfgklmnprstvz][aeiou])+[bdfgklmnprstvz]?", n) for n in names)
    assert not set(names) & set(COLORS + DAYS + STATUSES)
    assert all(re.fullmatch(r"[A-Z]\d{3}", o) for o in world.orders)
    assert all(re.fullmatch(r"[A-Z]{5}", c) for c in world.coupons)


def test_consistency():
    world = make_world(1)
    for order in world.orders.values():
        assert order.status in STATUSES and 1 <= len(order.lines) <= 3
        assert order.total == sum(ln.quantity * world.products[ln.product].price
                                  for ln in order.lines)
    for product in world.products.values():
        assert product.maker in world.makers and product.color in COLORS
    assert all(tuple(days) == DAYS for days in world.weather.values())
    assert world.order(next(iter(world.orders)).lower()) is not None
    assert world.product(next(iter(world.products)).upper()) is not None
    assert world.units is UNITS
