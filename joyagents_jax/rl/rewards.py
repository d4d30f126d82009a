"""Episode rewards R = R_A + R_F - R_E (+ R_G), on the host.

R_A in [0, 1] comes from an answer checker: normalized exact match (`text`), numeric equality
with tolerance (`number`) or structural equality of a JSON function call (`call`). R_F rewards
well-formed nodes, R_E penalizes LLM calls beyond the task's minimum. R_G, off by default (not
the paper's), rewards grounded copies: the share of the words an agent puts into tool arguments
and answers that occur in what it read. The memory learns from R_A + R_F (the paper leaves
R_E out). Checkers never raise on any model output.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import unicodedata
from typing import Any, Literal, NamedTuple

import numpy as np

AnswerKind = Literal["text", "number", "call"]
GROUNDING_MATCHES = ("word", "chars")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward weights and numeric tolerances.

    w_format 0.1: a well-formed wrong answer (0.1) stays far below a correct one (1.1), so group
    variance comes mainly from correctness while format is still learned. w_efficiency 0.05: one
    extra LLM call costs half the format reward, yet a correct answer (1.1 - 0.05 k with k extra
    calls) beats a wrong minimal one (0.1) for k < 20, more than an episode's node limit allows,
    so efficiency never outweighs correctness. Tolerances apply to non-integers only (integers
    such as ids and counts must match exactly); rel_tol 1e-6 keeps amounts up to 10,000 distinct
    to the cent. w_grounding 0 leaves R_G out (the paper's reward); grounding_match "word"
    counts a copied word only when it occurs verbatim, "chars" gives a near copy partial credit
    (`grounded_share`).
    """
    w_format: float = 0.1
    w_efficiency: float = 0.05
    w_grounding: float = 0.0
    grounding_match: Literal["word", "chars"] = "word"
    rel_tol: float = 1e-6
    abs_tol: float = 1e-9

    def __post_init__(self):
        bad = {k: v for k, v in dataclasses.asdict(self).items()
               if k != "grounding_match" and not v >= 0}
        if bad:
            raise ValueError(f"RewardConfig fields must be >= 0, got {bad}.")
        if self.grounding_match not in GROUNDING_MATCHES:
            raise ValueError(f"RewardConfig.grounding_match must be one of {GROUNDING_MATCHES}, "
                             f"got {self.grounding_match!r}.")

    @property
    def best_memory_reward(self) -> float:
        """The largest R_A + R_F: a correct answer with every node well formed."""
        return 1.0 + self.w_format


# ------------------------------------------------------------------------------------------------
# Answer checkers (R_A).
# ------------------------------------------------------------------------------------------------

_STRIP = ".,;:!?\"'`“”‘’«»… "  # Stripped from both ends of a text answer.
_ARTICLE = re.compile(r"(?:a|an|the) ")
_NUMBER = re.compile(r"""
    (?<![\w.])                              # not inside a word or a number
    (?P<sign>[-+\u2212]?)                   # ASCII sign or U+2212 minus
    [$€£¥]?                                 # currency sign
    (?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)  # 1,234.5 or 1234 or .5
    (?:[eE](?P<exp>[-+]?\d+))?
    (?:/(?P<den>\d+))?                      # a fraction: 3/4
    """, re.VERBOSE)


def normalize_text(text: str) -> str:
    """Unicode NFKC, casefold, single spaces, no punctuation or quotes at the ends, no leading
    article (a, an, the). Inner punctuation is kept: ids like "ORD-12" and "ORD12" stay distinct.
    """
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split()).strip(_STRIP)
    article = _ARTICLE.match(text)
    return text[article.end():].strip(_STRIP) if article else text


def extract_number(text: str) -> float | None:
    """The last number written in `text`, or None.

    Understands signs, thousands commas (1,234.5), currency signs, scientific notation and
    fractions (3/4); trailing units and percent signs are ignored ("50%" is 50, "3 kg" is 3).
    Mixed numbers are not: "1 1/2" reads as its last number, 0.5.
    """
    value = None
    for match in _NUMBER.finditer(text):
        value = _number_value(match)
    return value


def _number_value(match: re.Match) -> float | None:
    """The match's value; None for a zero denominator or a value beyond float range."""
    value = float(f"{match['num'].replace(',', '')}e{match['exp'] or 0}")
    if match["den"] is not None:
        value = value / float(match["den"]) if float(match["den"]) else math.nan
    value = -value if match["sign"] in ("-", "\u2212") else value
    return value if math.isfinite(value) else None


def check_answer(predicted: str, gold: str, kind: AnswerKind,
                 cfg: RewardConfig = RewardConfig()) -> float:
    """R_A: 1.0 if `predicted` matches `gold` under the checker `kind`, else 0.0."""
    if kind == "text":
        return float(normalize_text(predicted) == normalize_text(gold))
    if kind == "number":
        p, g = extract_number(predicted), extract_number(gold)
        return float(p is not None and g is not None and _numbers_equal(p, g, cfg))
    if kind == "call":
        p, g = _load_json(predicted), _load_json(gold)
        if not (isinstance(p, dict) and isinstance(g, dict)):
            return 0.0
        try:
            return float(_json_equal(p, g, cfg))
        except RecursionError:  # Absurdly deep JSON.
            return 0.0
    raise ValueError(f"Unknown answer kind {kind!r}; expected text, number or call.")


def _numbers_equal(a: float, b: float, cfg: RewardConfig) -> bool:
    """Exact for two integers, else within the relative or absolute tolerance."""
    if float(a).is_integer() and float(b).is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=cfg.rel_tol, abs_tol=cfg.abs_tol)


def _load_json(text: str) -> Any:
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_number(value: Any) -> float | None:
    """A JSON number, or a string that is exactly one number ("12", "$1,200"), as a float."""
    if _is_number(value):
        try:
            value = float(value)
        except OverflowError:  # An integer beyond float range.
            return None
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        match = _NUMBER.fullmatch(value.strip())
        return None if match is None else _number_value(match)
    return None


def _json_equal(a: Any, b: Any, cfg: RewardConfig) -> bool:
    """Structural equality: any key order, numbers by value, strings as normalized text.

    A number equals a string that spells it (models often quote ids); booleans and null only
    equal themselves.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k], cfg) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y, cfg) for x, y in zip(a, b))
    if type(a) is int and type(b) is int:  # Not bool: a bool's type is bool.
        return a == b  # Exact, even beyond float range.
    if _is_number(a) or _is_number(b):
        x, y = _json_number(a), _json_number(b)
        return x is not None and y is not None and _numbers_equal(x, y, cfg)
    if isinstance(a, str) and isinstance(b, str):
        return normalize_text(a) == normalize_text(b)
    return type(a) is type(b) and a == b


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------
# Grounding (R_G): copied words that occur in the agent's context.
# ------------------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W_]+(?:\.\d+)?")  # "13.69" is one word, "convert_units" two.


def words(text: str) -> list[str]:
    """The casefolded words of `text`: letter and digit runs, a decimal number kept whole."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def grounded_share(copied: str, context: str, match: str = "word") -> float | None:
    """The mean credit of `copied`'s words against `context`'s words; None without words.

    match "word": a word scores 1 when it occurs in the context, else 0. "chars": a word not in
    the context scores its best character similarity to a context word (difflib's ratio,
    2 x matching characters / total characters), so "shenzen" copied from "shenzhen" earns 0.93
    where "word" gives nothing. A tool argument or an answer that names a city, a number or an
    id the agent never read scores below 1; on the suite's gold trajectories tool arguments and
    answers score 0.99-1.0.
    """
    out = words(copied)
    if not out:
        return None
    seen = set(words(context))
    credit = lambda w: 1.0 if w in seen else (_near_copy(w, seen) if match == "chars" else 0.0)
    return sum(map(credit, out)) / len(out)


def _near_copy(word: str, seen: set[str]) -> float:
    """The best difflib ratio of `word` to a word of `seen` (0 when `seen` is empty)."""
    matcher = difflib.SequenceMatcher(b=word, autojunk=False)
    best = 0.0
    for other in seen:
        matcher.set_seq1(other)
        if matcher.real_quick_ratio() > best and matcher.quick_ratio() > best:
            best = max(best, matcher.ratio())
    return best


# ------------------------------------------------------------------------------------------------
# The reward (R_A + R_F - R_E + R_G).
# ------------------------------------------------------------------------------------------------


class RewardParts(NamedTuple):
    """Each part as float32 arrays shaped like the inputs (0-d for scalars)."""
    r_answer: np.ndarray
    r_format: np.ndarray
    r_efficiency: np.ndarray  # The penalty R_E, subtracted from the total.
    r_grounding: np.ndarray
    total: np.ndarray  # R_A + R_F - R_E + R_G, the GRPO reward.
    memory_reward: np.ndarray  # R_A + R_F, what the memory learns from.


def reward_parts(answer_score, n_nodes, n_wellformed_nodes, n_llm_calls, min_llm_calls,
                 cfg: RewardConfig = RewardConfig(), grounding=0.0) -> RewardParts:
    """The reward of one episode, or of a batch (array-likes broadcast together).

    R_F = w_format * well-formed nodes / nodes (0 for an episode without nodes);
    R_E = w_efficiency * max(0, LLM calls - the task's minimum); memory hits are not LLM calls;
    R_G = w_grounding * grounding, the episode's grounded share in [0, 1].
    """
    r_a, r_g = np.asarray(answer_score, np.float64), np.asarray(grounding, np.float64)
    nodes, good, calls, min_calls = (np.asarray(x, np.int64) for x in
                                     (n_nodes, n_wellformed_nodes, n_llm_calls, min_llm_calls))
    for name, x, value in (("answer_score", r_a, answer_score), ("grounding", r_g, grounding)):
        if np.any((x < 0) | (x > 1) | ~np.isfinite(x)):
            raise ValueError(f"{name} must lie in [0, 1], got {value}.")
    if np.any((good < 0) | (good > nodes) | (calls < 0) | (min_calls < 0)):
        raise ValueError("Counts must satisfy 0 <= n_wellformed_nodes <= n_nodes and "
                         f"n_llm_calls, min_llm_calls >= 0; got nodes={n_nodes}, "
                         f"wellformed={n_wellformed_nodes}, calls={n_llm_calls}, "
                         f"min_calls={min_llm_calls}.")
    r_f = cfg.w_format * np.divide(good, nodes, out=np.zeros(np.broadcast(good, nodes).shape),
                                   where=nodes > 0)
    r_e = cfg.w_efficiency * np.maximum(0, calls - min_calls)
    r_a, r_f, r_e, r_g = np.broadcast_arrays(r_a, r_f, r_e, cfg.w_grounding * r_g)
    parts = (r_a, r_f, r_e, r_g, r_a + r_f - r_e + r_g, r_a + r_f)
    return RewardParts(*(np.asarray(x, np.float32) for x in parts))
