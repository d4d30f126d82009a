"""Rewards: answer checkers (true and false cases, hostile inputs), grounding, and
R = R_A + R_F - R_E + R_G."""

import json
import random

import numpy as np
import pytest

from joyagents_jax.rl.rewards import (
    RewardConfig, check_answer, extract_number, grounded_share, normalize_text, reward_parts,
    words)

# ------------------------------------------------------------------------------------------------
# Text.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("predicted, gold", [
    ("Paris", "paris"),
    ("  Paris. ", "Paris"),
    ('"Paris"', "Paris"),
    ("“Paris”!", "Paris"),
    ("The Eiffel Tower", "eiffel tower"),
    ("an apple", "Apple"),
    ("a  blue\n widget", "Blue Widget"),
    ("STRASSE", "straße"),  # casefold
    ("ｆｕｌｌ ｗｉｄｔｈ", "full width"),  # NFKC
    ("ORD-12.", "ord-12"),
    ("A", "a"),  # A lone "a" is an answer, not an article.
    ("the", "The"),
    ("", ""),
])
def test_text_matches(predicted, gold):
    assert check_answer(predicted, gold, "text") == 1.0


@pytest.mark.parametrize("predicted, gold", [
    ("Paris", "London"),
    ("ORD-12", "ORD12"),  # Inner punctuation is kept.
    ("blue widget", "widget blue"),
    ("Paris, France", "Paris"),
    ("theater", "ater"),  # "the" is only an article as its own word.
    ("12", "12.0"),  # Numbers need the number checker.
    ("", "Paris"),
    ("Paris", ""),
])
def test_text_mismatches(predicted, gold):
    assert check_answer(predicted, gold, "text") == 0.0


def test_normalize_text():
    assert normalize_text("  The  Blue\t\n Widget... ") == "blue widget"
    assert normalize_text("The 'Blue' Widget") == "blue' widget"  # Quotes go at the ends only.
    assert normalize_text(" ' . ' ") == ""


# ------------------------------------------------------------------------------------------------
# Numbers.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-7", -7.0), ("+3", 3.0), ("\u22122.5", -2.5), (".5", 0.5), ("0.50", 0.5),
    ("1,234", 1234.0), ("1,234,567.89", 1234567.89), ("$12.50", 12.5), ("-$5", -5.0),
    ("€3", 3.0), ("1e3", 1000.0), ("2.5E-2", 0.025), ("3/4", 0.75), ("-1/2", -0.5),
    ("50%", 50.0), ("3 kg", 3.0), ("12kg", 12.0), ("5th", 5.0),
    ("The total is $1,234.50.", 1234.5), ("3 + 4 = 7", 7.0), ("#### 72", 72.0),
    ("1.2.3", 1.2), ("x5 km2 H2O", None), ("", None), ("no number", None), ("1/0", None),
    ("1e999", None), ("-", None), ("$", None), ("1,2345", 2345.0),
])
def test_extract_number(text, value):
    assert extract_number(text) == value


@pytest.mark.parametrize("predicted, gold", [
    ("72", "72"), ("72.0", "72"), ("The answer is 72.", "72"), ("$1,200", "1200"),
    ("1200 dollars", "$1,200.00"), ("0.75", "3/4"), ("75%", "75"), ("-3", "−3"),
    ("3.3333333", "3.33333333"),  # Within the relative tolerance.
    ("1e-12", "0"),  # Within the absolute tolerance.
    ("so 3 apples then 5", "5"),  # The last number counts.
])
def test_number_matches(predicted, gold):
    assert check_answer(predicted, gold, "number") == 1.0


@pytest.mark.parametrize("predicted, gold", [
    ("71", "72"), ("72.5", "72"), ("123456788", "123456789"),  # Integers match exactly.
    ("199.98", "199.99"), ("0.33", "1/3"), ("5 then 3", "5"), ("seventy-two", "72"),
    ("", "72"), ("72", ""), ("1/0", "1/0"), ("0.75", "75%"),  # A percent sign is a unit.
])
def test_number_mismatches(predicted, gold):
    assert check_answer(predicted, gold, "number") == 0.0


def test_number_tolerance_comes_from_config():
    assert check_answer("3.1416", "3.14159", "number") == 0.0
    assert check_answer("3.1416", "3.14159", "number", RewardConfig(rel_tol=1e-4)) == 1.0
    assert check_answer("1e-7", "0", "number", RewardConfig(abs_tol=1e-6)) == 1.0
    assert check_answer("101", "100", "number", RewardConfig(rel_tol=0.1)) == 0.0  # Integers.


# ------------------------------------------------------------------------------------------------
# Function calls.
# ------------------------------------------------------------------------------------------------

GOLD_CALL = json.dumps({"name": "refund_order",
                        "arguments": {"order_id": 1042, "amount": 12.5, "reason": "Damaged item",
                                      "items": [{"sku": "A-1", "qty": 2}], "express": False,
                                      "note": None}})


@pytest.mark.parametrize("predicted", [
    GOLD_CALL,
    '{"arguments": {"note": null, "express": false, "items": [{"qty": 2, "sku": "a-1"}],'
    ' "reason": "damaged item.", "amount": 12.50, "order_id": 1042}, "name": "Refund_Order"}',
    '{"name":"refund_order","arguments":{"order_id":"1042","amount":"12.5",'
    '"reason":"Damaged  item","items":[{"sku":"A-1","qty":2.0}],"express":false,"note":null}}',
    "\n " + GOLD_CALL + " \n",
])
def test_call_matches(predicted):
    assert check_answer(predicted, GOLD_CALL, "call") == 1.0


def _gold_with(**changes) -> str:
    call = json.loads(GOLD_CALL)
    call["arguments"].update(changes)
    return json.dumps(call)


@pytest.mark.parametrize("predicted", [
    _gold_with(order_id=1043),
    _gold_with(amount=12.51),
    _gold_with(reason="Wrong size"),
    _gold_with(items=[{"sku": "A-1", "qty": 3}]),
    _gold_with(items=[{"sku": "A-1", "qty": 2}, {"sku": "A-1", "qty": 2}]),
    _gold_with(express=True),
    _gold_with(express=0),  # A boolean is not a number.
    _gold_with(note="null"),
    _gold_with(extra=1),
    json.dumps({"name": "cancel_order", "arguments": json.loads(GOLD_CALL)["arguments"]}),
    json.dumps({"name": "refund_order"}),
    GOLD_CALL[:-1],  # Malformed JSON.
    "refund_order(order_id=1042)",
    "", "null", "[]", '"refund_order"',
    "<tool_call>" + GOLD_CALL + "</tool_call>",
])
def test_call_mismatches(predicted):
    assert check_answer(predicted, GOLD_CALL, "call") == 0.0


def test_call_numbers():
    call = lambda v: json.dumps({"name": "f", "arguments": {"x": v}})  # noqa: E731
    assert check_answer(call(10**30), call(10**30), "call") == 1.0  # Exact beyond float range.
    assert check_answer(call(10**30), call(10**30 + 1), "call") == 0.0
    assert check_answer(call(10**400), call(1e300), "call") == 0.0
    assert check_answer(call(0.1 + 0.2), call(0.3), "call") == 1.0
    assert check_answer(call("0.3"), call("0.30"), "call") == 0.0  # Two strings compare as text.
    assert check_answer(call("$1,200"), call(1200), "call") == 1.0
    assert check_answer(call("1/0"), call(1), "call") == 0.0
    assert check_answer(call(True), call(1), "call") == 0.0


# ------------------------------------------------------------------------------------------------
# Hostile inputs.
# ------------------------------------------------------------------------------------------------

HOSTILE = ["", " " * 100_000 + "x", "9" * 100_000, "1" + "0" * 5000 + "/" + "0" * 5000,
           "1e" + "9" * 5000, "[" * 100_000, '{"a":' * 2000 + "1" + "}" * 2000,
           "1" * 5000, "1,000," * 10_000, "\x00\ud800\uffff", "NaN", "Infinity", "-Infinity",
           '{"name": NaN}', "$" * 1000, "." * 1000, "/" * 1000, "e" * 1000, "𝟙𝟚𝟛"]


@pytest.mark.parametrize("kind", ["text", "number", "call"])
def test_hostile_inputs_never_raise(kind):
    rng = random.Random(0)
    pieces = ["1", "0", ",", ".", "/", "-", "e", "$", "%", " ", "{", "}", "[", "]", '"', ":",
              "a", "the ", "null", "true", "1e999"]
    texts = HOSTILE + ["".join(rng.choice(pieces) for _ in range(rng.randrange(25)))
                       for _ in range(500)]
    for predicted in texts:
        for gold in (predicted, "42", GOLD_CALL, "Paris"):
            assert check_answer(predicted, gold, kind) in (0.0, 1.0)


def test_deep_json_call_is_a_mismatch():
    deep = '{"name": "f", "arguments": ' + '{"a":' * 900 + "1" + "}" * 901
    assert check_answer(deep, deep, "call") in (0.0, 1.0)


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="Unknown answer kind 'regex'"):
        check_answer("a", "a", "regex")


# ------------------------------------------------------------------------------------------------
# R = R_A + R_F - R_E.
# ------------------------------------------------------------------------------------------------


def test_words_split_names_and_keep_decimals_whole():
    assert words("Convert 388 g to oz: 13.69, convert_units!") == [
        "convert", "388", "g", "to", "oz", "13.69", "convert", "units"]
    assert words("ＡＢＣ Café") == ["abc", "café"]  # NFKC, casefolded.
    assert words(" ,;- ") == []


@pytest.mark.parametrize("copied, context, share", [
    ("13.69", "388 g = 13.69 oz", 1.0),
    ("3", "388 g = 13.69 oz", 0.0),  # Not a word of the context: "388" and "13.69" are.
    ("todap saturday", "What is the weather in todap on Saturday?", 1.0),
    ("rekeg saturday", "What is the weather in todap on Saturday?", 0.5),
    ("", "anything", None),
    ("!!", "anything", None),
])
def test_grounded_share(copied, context, share):
    assert grounded_share(copied, context) == share


@pytest.mark.parametrize("copied, context, share", [
    ("13.69", "388 g = 13.69 oz", 1.0),  # verbatim words keep full credit
    ("shenzen", "ship to Shenzhen", 14 / 15),  # 2 x 7 matching characters / 15 characters
    ("rekeg saturday", "What is the weather in todap on Saturday?", (1 / 3 + 1.0) / 2),
    ("xyz", "abc", 0.0),
    ("xyz", "", 0.0),  # nothing read: no word to be near
    ("!!", "anything", None),
])
def test_grounded_share_by_characters(copied, context, share):
    """A word's credit is its best ratio: "rekeg" is nearest "weather" (2 x 2 shared / 12)."""
    got = grounded_share(copied, context, "chars")
    assert got == share if share is None else got == pytest.approx(share)


def test_character_credit_never_falls_below_word_credit():
    rng = np.random.default_rng(0)
    vocab = ["order", "z476", "ohxus", "shenzhen", "13.69", "coupon", "oz", "saturday"]
    for _ in range(50):
        context = " ".join(rng.choice(vocab, 4))
        copied = " ".join(w[: rng.integers(1, len(w) + 1)] for w in rng.choice(vocab, 3))
        word, chars = grounded_share(copied, context), grounded_share(copied, context, "chars")
        assert word <= chars <= 1.0


def test_reward_parts_scalar():
    parts = reward_parts(1.0, n_nodes=4, n_wellformed_nodes=4, n_llm_calls=4, min_llm_calls=3)
    np.testing.assert_allclose(parts, [1.0, 0.1, 0.05, 0.0, 1.05, 1.1], rtol=1e-6)
    assert all(p.shape == () and p.dtype == np.float32 for p in parts)


def test_reward_parts_batch_and_config():
    cfg = RewardConfig(w_format=0.2, w_efficiency=0.1)
    parts = reward_parts(answer_score=[1.0, 0.0, 0.0, 1.0],
                         n_nodes=[2, 4, 0, 3], n_wellformed_nodes=[2, 1, 0, 3],
                         n_llm_calls=[2, 6, 0, 1], min_llm_calls=2, cfg=cfg)
    np.testing.assert_allclose(parts.r_answer, [1, 0, 0, 1])
    np.testing.assert_allclose(parts.r_format, [0.2, 0.05, 0.0, 0.2], rtol=1e-6)  # 0 nodes: 0.
    np.testing.assert_allclose(parts.r_efficiency, [0.0, 0.4, 0.0, 0.0], rtol=1e-6)  # >= 0.
    np.testing.assert_allclose(parts.total, [1.2, -0.35, 0.0, 1.2], rtol=1e-6)
    np.testing.assert_allclose(parts.memory_reward, [1.2, 0.05, 0.0, 1.2], rtol=1e-6)
    assert all(p.shape == (4,) for p in parts)


def test_grounding_enters_the_total_only_when_weighted():
    shares = [1.0, 0.5, 0.0]
    off = reward_parts(0.0, 2, 2, 2, 2, grounding=shares)
    np.testing.assert_allclose(off.r_grounding, [0, 0, 0])
    np.testing.assert_allclose(off.total, [0.1, 0.1, 0.1], rtol=1e-6)
    on = reward_parts(0.0, 2, 2, 2, 2, RewardConfig(w_grounding=0.2), grounding=shares)
    np.testing.assert_allclose(on.r_grounding, [0.2, 0.1, 0.0], rtol=1e-6)
    np.testing.assert_allclose(on.total, [0.3, 0.2, 0.1], rtol=1e-6)
    np.testing.assert_allclose(on.memory_reward, [0.1, 0.1, 0.1], rtol=1e-6)  # R_A + R_F only.


def test_correctness_dominates_format_and_efficiency():
    cfg = RewardConfig()
    correct_slow = reward_parts(1.0, 19, 19, 19, 1, cfg).total  # 18 extra calls.
    wrong_fast = reward_parts(0.0, 1, 1, 1, 1, cfg).total
    correct_malformed = reward_parts(1.0, 2, 0, 2, 2, cfg).total
    assert correct_slow > wrong_fast and correct_malformed > wrong_fast
    assert cfg.best_memory_reward == pytest.approx(1.1)


@pytest.mark.parametrize("args", [(1.5, 1, 1, 1, 1), (-0.1, 1, 1, 1, 1), (np.nan, 1, 1, 1, 1),
                                  (1.0, 2, 3, 1, 1), (1.0, 2, -1, 1, 1), (1.0, 2, 2, -1, 1),
                                  (1.0, 2, 2, 1, -1), ([1.0, 2.0], 1, 1, 1, 1)])
def test_reward_parts_rejects_bad_inputs(args):
    with pytest.raises(ValueError):
        reward_parts(*args)


@pytest.mark.parametrize("grounding", [1.5, -0.1, np.nan])
def test_reward_parts_rejects_bad_grounding(grounding):
    with pytest.raises(ValueError, match="grounding must lie in"):
        reward_parts(1.0, 1, 1, 1, 1, grounding=grounding)


def test_reward_config_rejects_negative_weights():
    with pytest.raises(ValueError, match="w_efficiency"):
        RewardConfig(w_efficiency=-0.1)
    with pytest.raises(ValueError, match="grounding_match must be one of"):
        RewardConfig(grounding_match="letters")
