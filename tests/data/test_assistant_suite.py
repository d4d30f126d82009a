"""The assistant suite: determinism, splits, popularity skew, and gold trajectories that replay."""

import collections
import dataclasses
import json
import re

import pytest

from joyagents_jax.agents.tools import AGENT_TOOLS, TOOLS, run_tool
from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.data.assistant_suite import DOMAINS, MASTER, SPLITS, TINY

_CALL = re.compile(r'<call agent="(\w+)"(?:/>|>(.+)</call>)', re.S)
_TOOL = re.compile(r'<tool name="(\w+)">(.*)</tool>', re.S)
_ANSWER = re.compile(r"<answer>(.*)</answer>", re.S)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return suite.load_suite("tiny", tmp_path_factory.mktemp("suite"))


@pytest.fixture(scope="module")
def splits(sources):
    return {name: [suite.decode(source[i]) for i in range(len(source))]
            for name, source in sources.items()}


def test_build_matches_generation_and_is_deterministic(splits, tmp_path):
    generated = suite.generate_splits(TINY)
    assert generated == suite.generate_splits(TINY)
    assert {k: [suite.decode(r) for r in v] for k, v in generated.items()} == splits
    rebuilt = suite.load_suite(TINY, tmp_path)
    assert {k: [suite.decode(s[i]) for i in range(len(s))] for k, s in rebuilt.items()} == splits


def test_seed_changes_the_traffic():
    other = suite.generate_splits(dataclasses.replace(TINY, seed=1, num_train=50))
    assert [r["query"] for r in other["train"]] != [
        r["query"] for r in suite.generate_splits(TINY)["train"][:50]]


def test_split_sizes_and_domains(splits):
    sizes = (TINY.num_train, TINY.num_validation, TINY.num_test, TINY.num_test_novel)
    assert tuple(len(splits[name]) for name in SPLITS) == sizes
    for examples in splits.values():
        assert {e.domain for e in examples} == set(DOMAINS)
    assert {e.answer_kind for e in splits["train"]} == set(suite.ANSWER_KINDS)


def _sub_queries(example):
    return {m.group(2) for n in example.gold if n.agent == MASTER
            for m in [_CALL.fullmatch(n.output)] if m and m.group(2)}


def test_test_novel_never_occurs_in_train(splits):
    train = splits["train"]
    seen_queries = {e.query for e in train} | set().union(*map(_sub_queries, train))
    novel = splits["test_novel"]
    assert not {e.question_id for e in novel} & {e.question_id for e in train}
    assert not {e.query for e in novel} & seen_queries
    assert len({e.question_id for e in novel}) == len(novel)  # distinct questions


def test_popular_questions_recur(splits):
    counts = collections.Counter(e.question_id for e in splits["train"])
    (_, top), mean = counts.most_common(1)[0], len(splits["train"]) / len(counts)
    assert top >= 10 * mean and len(counts) < 0.5 * len(splits["train"])
    shared = {e.question_id for e in splits["test"]} & set(counts)
    assert len(shared) > len(splits["test"]) // 4  # same traffic: popular questions reappear


def test_question_id_identifies_the_question(splits):
    by_id = {}
    for examples in splits.values():
        for e in examples:
            assert by_id.setdefault(e.question_id, e) == e


def _replay(example, world):
    """Walk a gold trajectory as the engine would: checks the protocol and runs every tool."""
    master_answers, pending = [], None  # pending: the sub-agent the master last called
    last_observation = None
    for node in example.gold:
        if node.agent == MASTER:
            assert node.observation is None and pending is None
            call, answer = _CALL.fullmatch(node.output), _ANSWER.fullmatch(node.output)
            assert call or answer, node.output
            if call:
                pending = call.group(1)
            else:
                master_answers.append(answer.group(1))
            continue
        assert node.agent == pending, (node, pending)
        tool, answer = _TOOL.fullmatch(node.output), _ANSWER.fullmatch(node.output)
        if tool:
            assert tool.group(1) in AGENT_TOOLS[node.agent]
            observation = run_tool(tool.group(1), tool.group(2), world)
            assert observation == node.observation and not observation.startswith("error")
            last_observation = observation
        else:
            assert answer and node.observation is None, node.output
            pending = None
            sub_answer = answer.group(1)
            if example.answer_kind != "call":  # the answer is copied from the observation
                assert sub_answer in re.split(r"[\s,;:]+", last_observation), last_observation
    assert master_answers == [example.answer] and example.gold[-1].agent == MASTER
    return sub_answer


def test_gold_trajectories_replay(splits):
    world = suite.suite_world("tiny")
    for examples in splits.values():
        for example in examples:
            assert example.min_llm_calls == len(example.gold)
            assert _replay(example, world) == example.answer


def test_gold_shapes_per_domain(splits):
    world = suite.suite_world(TINY)
    for e in splits["train"]:
        if e.domain == "cooperation":  # two explicit sub-queries; the second uses the first answer
            calls = [_CALL.fullmatch(n.output) for n in e.gold if n.agent == MASTER]
            first, second = [m.group(2) for m in calls if m]
            first_answer = _ANSWER.fullmatch(e.gold[2].output).group(1)
            assert e.min_llm_calls == 7 and first and first_answer in re.split(r"[ ?.]", second)
        elif e.answer_kind == "call":
            assert e.min_llm_calls == 3 and e.domain == "efc"
            call = json.loads(e.answer)
            assert set(call) == {"name", "arguments"} and call["name"] in TOOLS
            assert not run_tool(call["name"], call["arguments"], world).startswith("error")
        else:
            assert e.min_llm_calls == 4 and e.gold[0].output == f'<call agent="{e.domain}"/>'


def test_math_difficulty_is_configured():
    config = dataclasses.replace(TINY, name="hard", math_steps=(3, 3), questions_per_domain=60,
                                 num_train=100, num_validation=10, num_test=10, num_test_novel=10)
    records = [r for r in suite.generate_splits(config)["train"] if r["domain"] == "math"]
    assert records
    for record in records:
        tool_node = json.loads(record["gold"])[1]
        args = json.loads(_TOOL.fullmatch(tool_node["output"]).group(2))
        assert len(re.findall(r" [-+*/] ", args["expression"])) == 3


def test_custom_config_gets_its_own_build(tmp_path):
    small = dataclasses.replace(TINY, questions_per_domain=40, num_train=30, num_validation=5,
                                num_test=5, num_test_novel=20)
    sources = suite.load_suite(small, tmp_path)
    assert [len(sources[s]) for s in SPLITS] == [30, 5, 5, 20]
    assert len(suite.load_suite(TINY, tmp_path)["train"]) == TINY.num_train


@pytest.mark.parametrize("change, message", [
    ({"domain_weights": (("math", 1.0), ("chess", 1.0))}, "unknown domains"),
    ({"math_steps": (0, 2)}, "math_steps"),
    ({"novel_fraction": 0.0}, "novel_fraction"),
    ({"num_test_novel": 10_000}, "num_test_novel"),
])
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)
