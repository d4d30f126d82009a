"""The synthetic world behind the assistant suite: product knowledge base, store, weather, units.

`make_world(seed)` builds everything with one `random.Random(seed)` in milliseconds, identically in
every process (no hash-ordered containers are iterated). Entity names are random pronounceable
strings: a policy has to copy them from the query and the observations, because it
cannot have memorized them. Order ids and coupon codes are random as well. Lookups by name are
case-insensitive; tools (`agents/tools.py`) are the only code that reads a world at run time.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Mapping
from types import MappingProxyType

COLORS = ("red", "blue", "green", "black", "white", "gray", "pink", "gold")
CONDITIONS = ("sunny", "cloudy", "rain", "windy", "fog")  # "snow" below 1 C
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
STATUSES = ("pending", "shipped", "delivered", "cancelled")
COUPON_PERCENTS = (5, 10, 15, 20, 25)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class Product:
    name: str
    color: str
    price: int  # dollars
    maker: str
    weight_kg: int
    warranty_years: int


@dataclasses.dataclass(frozen=True)
class OrderLine:
    product: str
    quantity: int
    unit_price: int

    @property
    def amount(self) -> int:
        return self.quantity * self.unit_price


@dataclasses.dataclass(frozen=True)
class Order:
    order_id: str
    status: str
    lines: tuple[OrderLine, ...]

    @property
    def total(self) -> int:
        return sum(line.amount for line in self.lines)

    def line(self, product: str) -> OrderLine | None:
        return next((ln for ln in self.lines if ln.product == product.lower()), None)


@dataclasses.dataclass(frozen=True)
class Weather:
    condition: str
    temp_c: int


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit of `dimension`: a value v in this unit is `v * scale + offset` in the base unit."""

    dimension: str
    scale: float
    offset: float = 0.0


UNITS: Mapping[str, Unit] = MappingProxyType({
    "m": Unit("length", 1.0),
    "km": Unit("length", 1000.0),
    "cm": Unit("length", 0.01),
    "mi": Unit("length", 1609.344),
    "ft": Unit("length", 0.3048),
    "in": Unit("length", 0.0254),
    "kg": Unit("mass", 1.0),
    "g": Unit("mass", 0.001),
    "lb": Unit("mass", 0.45359237),
    "oz": Unit("mass", 0.028349523125),
    "l": Unit("volume", 1.0),
    "ml": Unit("volume", 0.001),
    "gal": Unit("volume", 3.785411784),
    "c": Unit("temperature", 1.0),
    "f": Unit("temperature", 5 / 9, -32 * 5 / 9),
    "k": Unit("temperature", 1.0, -273.15),
})


@dataclasses.dataclass(frozen=True)
class World:
    """Everything the tools can see. Mappings are keyed by lower-case name (upper-case ids)."""

    seed: int
    products: Mapping[str, Product]
    makers: tuple[str, ...]
    orders: Mapping[str, Order]
    coupons: Mapping[str, int]  # code -> percent off
    weather: Mapping[str, Mapping[str, Weather]]  # city -> day -> weather
    people: tuple[str, ...]  # first names for word problems
    units: Mapping[str, Unit]

    def order(self, order_id: str) -> Order | None:
        return self.orders.get(order_id.strip().upper())

    def product(self, name: str) -> Product | None:
        return self.products.get(name.strip().lower())


def make_world(seed: int, *, num_products: int = 64, num_makers: int = 12, num_orders: int = 48,
               num_coupons: int = 8, num_cities: int = 12, num_people: int = 16) -> World:
    """A world drawn from `seed`; the same arguments always give an equal world."""
    rng = random.Random(seed)
    taken = set(COLORS + CONDITIONS + DAYS + STATUSES) | set(UNITS)
    makers = tuple(_name(rng, taken) for _ in range(num_makers))
    products = {}
    for _ in range(num_products):
        product = Product(name=_name(rng, taken), color=rng.choice(COLORS),
                          price=rng.randint(2, 99), maker=rng.choice(makers),
                          weight_kg=rng.randint(1, 20), warranty_years=rng.randint(1, 5))
        products[product.name] = product
    orders = {}
    for _ in range(num_orders):
        order = _order(rng, tuple(products.values()), set(orders))
        orders[order.order_id] = order
    coupons = {}
    while len(coupons) < num_coupons:
        coupons["".join(rng.choices(string.ascii_uppercase, k=5))] = rng.choice(COUPON_PERCENTS)
    weather = {_name(rng, taken): {day: _weather(rng) for day in DAYS} for _ in range(num_cities)}
    people = tuple(_name(rng, taken, length=4).capitalize() for _ in range(num_people))
    return World(seed=seed, products=MappingProxyType(products), makers=makers,
                 orders=MappingProxyType(orders), coupons=MappingProxyType(coupons),
                 weather=MappingProxyType(weather), people=people, units=UNITS)


def _name(rng: random.Random, taken: set[str], length: int = 5) -> str:
    """A fresh consonant-vowel string such as 'bokar', never one already in `taken`."""
    while True:
        letters = (_CONSONANTS if i % 2 == 0 else _VOWELS for i in range(length))
        name = "".join(rng.choice(pool) for pool in letters)
        if name not in taken:
            taken.add(name)
            return name


def _order(rng: random.Random, products: tuple[Product, ...], taken: set[str]) -> Order:
    while True:
        order_id = rng.choice(string.ascii_uppercase) + str(rng.randint(100, 999))
        if order_id not in taken:
            break
    chosen = rng.sample(products, rng.randint(1, 3))
    lines = tuple(OrderLine(p.name, rng.randint(1, 4), p.price) for p in chosen)
    return Order(order_id=order_id, status=rng.choice(STATUSES), lines=lines)


def _weather(rng: random.Random) -> Weather:
    temp = rng.randint(-8, 35)
    condition = "snow" if temp < 1 and rng.random() < 0.6 else rng.choice(CONDITIONS)
    return Weather(condition=condition, temp_c=temp)
