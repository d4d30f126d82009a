"""The episode engine with scripted outputs: protocol, routing, tools, failures, gold replay."""

import pytest

from joyagents_jax.agents import protocol, system
from joyagents_jax.data import assistant_suite as suite
from joyagents_jax.data.world import make_world
from joyagents_jax.rl import rewards


@pytest.fixture(scope="module")
def world():
    return make_world(0)


def _system(world, **limits):
    return system.make_system(world, limits=system.Limits(**limits))


def _price_query(world):
    product = next(iter(world.products.values()))
    return product, f"What is the price of the {product.name}?"


def test_routing_tool_call_and_answer(world):
    product, query = _price_query(world)
    ep = system.Episode(_system(world), query)
    assert ep.pending() == system.Request("master", query, ())
    ep.apply('<call agent="qa"/>')
    assert ep.pending().agent == "qa" and ep.pending().query == query  # forwarded unchanged
    ep.apply(f'<tool name="kb_search">{{"query":"{product.name}"}}</tool>')
    (output, observation), = ep.pending().turns
    assert f"price {product.price}" in observation and ep.tool_calls == 1
    ep.apply(f"<answer>{product.price}</answer>")
    request = ep.pending()
    assert request.agent == "master" and request.turns == (('<call agent="qa"/>', str(product.price)),)
    ep.apply(f"<answer>{product.price}</answer>")
    assert ep.done and ep.end == "answer" and ep.answer == str(product.price)
    parts = ep.reward(str(product.price), "number", min_llm_calls=4)
    assert parts.r_answer == 1.0 and parts.r_efficiency == 0.0 and parts.r_format == pytest.approx(0.1)


def test_cooperation_through_two_sub_agents(world):
    ep = system.Episode(_system(world), "How much is 3 times the price of X?")
    ep.apply('<call agent="qa">price of X?</call>')
    ep.apply("<answer>12</answer>")
    ep.apply('<call agent="math">What is 3 * 12?</call>')
    assert ep.pending() == system.Request("math", "What is 3 * 12?", ())
    ep.apply('<tool name="calculator">{"expression":"3 * 12"}</tool>')
    assert ep.pending().turns[0][1] == "36"
    ep.apply("<answer>36</answer>")
    assert [t[1] for t in ep.pending().turns] == ["12", "36"]
    ep.apply("<answer>36</answer>")
    assert ep.answer == "36" and len(ep.nodes) == 6 and ep.llm_calls == 6


@pytest.mark.parametrize("outputs, end, observation", [
    (["<answer>unclosed"], "malformed", None),
    (["hello"], "malformed", None),
    (['<call agent="qa"/>', '<tool name="kb_search">{not json}</tool>'], "malformed", None),
    (['<call agent="qa"/>', '<call agent="math"/>'], "malformed", None),  # wrong role
    (['<call agent="nobody"/>'], None, "error: unknown agent 'nobody'"),
    (['<call agent="master"/>'], None, "error: unknown agent 'master'"),
    (['<call agent="qa"/>', '<tool name="calculator">{"expression":"1+1"}</tool>'], None,
     "error: unknown tool 'calculator'"),
    (['<call agent="math"/>', '<tool name="calculator">{"expression":"1/0"}</tool>'], None,
     "error:"),
    (['<call agent="math"/>', '<tool name="calculator">{"expression":"__import__(1)"}</tool>'],
     None, "error:"),
    (['<call agent="math"/>', '<tool name="calculator">{"expr":"1"}</tool>'], None, "error:"),
])
def test_failure_paths_never_raise(world, outputs, end, observation):
    ep = system.Episode(_system(world), "q")
    for o in outputs:
        ep.apply(o)
    if end is not None:
        assert ep.end == end and ep.answer is None
        assert ep.reward("x", "text", 2).r_answer == 0.0
        assert not ep.nodes[-1].wellformed
    else:
        assert not ep.done and ep.pending().turns[-1][1].startswith(observation)


def test_node_limit_and_truncation_end_cleanly(world):
    ep = system.Episode(_system(world, max_nodes=3), "q")
    for _ in range(3):
        ep.apply('<call agent="nobody"/>')
    assert ep.end == "node_limit" and ep.pending() is None
    with pytest.raises(ValueError, match="finished episode"):
        ep.apply("<answer>1</answer>")
    ep = system.Episode(_system(world), "q")
    ep.apply("<answer>1", truncated=True)
    assert ep.end == "truncated" and ep.reward("1", "number", 2).r_format == 0.0


def test_long_observations_are_clipped(world):
    ep = system.Episode(_system(world, max_observation_chars=16), "q")
    ep.apply('<call agent="qa"/>')
    ep.apply('<tool name="kb_search">{"query":"' + next(iter(world.products)) + '"}</tool>')
    assert len(ep.pending().turns[0][1]) == 16 and ep.pending().turns[0][1].endswith("[...]")


def test_replay_reaches_the_same_state(world):
    outputs = ['<call agent="math"/>', '<tool name="calculator">{"expression":"2+3"}</tool>']
    ep = system.Episode.replay(_system(world), "What is 2+3?", [(o, False) for o in outputs])
    assert ep.pending() == system.Request("math", "What is 2+3?", ((outputs[1], "5"),))


def test_every_gold_trajectory_earns_full_reward():
    """Checker, tools and protocol agree: replayed gold outputs reproduce observations and
    earn R_A = 1 with full R_F and no efficiency penalty, in every split."""
    sources = suite.generate_splits(suite.TINY)
    sys_ = system.make_system(suite.suite_world(suite.TINY))
    for split, records in sources.items():
        for record in records:
            ex = suite.decode(record)
            ep = system.demonstration(sys_, ex.query, [n.output for n in ex.gold])
            assert ep.end == "answer", (split, ex)
            observed = [n.turns for n in ep.nodes]
            for k, node in enumerate(ex.gold):
                if node.observation is not None:  # the next node of that agent sees it
                    assert observed[k + 1][-1] == (node.output, node.observation)
            parts = ep.reward(ex.answer, ex.answer_kind, ex.min_llm_calls)
            assert parts.r_answer == 1.0 and parts.r_efficiency == 0.0, ex
            assert parts.r_format == pytest.approx(0.1), ex


def test_grounding_scores_copies_against_what_the_agent_read(world):
    ep = system.Episode(_system(world), "Convert 388 g to oz.")
    ep.apply('<call agent="gfc"/>')
    ep.apply('<tool name="convert_units">{"value":388,"from_unit":"g","to_unit":"lb"}</tool>')
    ep.apply("<answer>3</answer>")  # the observation says something else
    ep.apply("<answer>3</answer>")  # copied from the gfc agent: grounded
    assert [n.grounding() for n in ep.nodes] == [None, 2 / 3, 0.0, 1.0]
    assert ep.grounding() == pytest.approx(5 / 9)
    parts = ep.reward("13.69", "number", 4, rewards.RewardConfig(w_grounding=0.3))
    assert parts.r_grounding == pytest.approx(0.3 * 5 / 9)
    assert ep.reward("13.69", "number", 4).r_grounding == 0.0  # w_grounding 0: off
    # By characters, the answer "3" is a near copy of the "388" it read (2 x 1 shared / 4
    # characters); "lb" shares no character with a word of the query.
    assert [n.grounding("chars") for n in ep.nodes] == [None, 2 / 3, 0.5, 1.0]
    chars = ep.reward("13.69", "number", 4,
                      rewards.RewardConfig(w_grounding=0.3, grounding_match="chars"))
    assert chars.r_grounding == pytest.approx(0.3 * ep.grounding("chars"))
    assert ep.grounding("chars") > ep.grounding()
    malformed = system.Episode(_system(world), "hi")
    malformed.apply("hello")
    assert malformed.nodes[0].grounding() is None and malformed.grounding() == 0.0


def test_grounding_reads_json_answers_by_their_values(world):
    ep = system.Episode(_system(world), "Apply coupon OHXUS to order Z476.")
    ep.apply('<call agent="efc"/>')
    ep.apply('<answer>{"name":"apply_coupon","arguments":{"order_id":"Z476","code":"OHXUS"}}'
             '</answer>')
    assert ep.nodes[1].grounding() == 1.0  # keys are schema; every value is in the query


def test_gold_trajectories_are_grounded():
    """R_G agrees with the demonstrations: gold copies what it read (a story's "double" is a
    2 it never wrote, so not quite every node scores 1)."""
    records = suite.generate_splits(suite.CPU)["train"]
    sys_ = system.make_system(suite.suite_world(suite.CPU))
    shares = [system.demonstration(sys_, ex.query, [n.output for n in ex.gold]).grounding()
              for ex in map(suite.decode, records)]
    assert min(shares) >= 0.8 and sum(shares) / len(shares) >= 0.99


def test_system_config_errors(world):
    with pytest.raises(ValueError, match="Unknown sub-agent"):
        system.make_system(world, agents=("qa", "chef"))
    with pytest.raises(ValueError, match="needs an agent named 'master'"):
        system.AgentSystem({"qa": protocol.AgentSpec("qa", "x")}, lambda n, a: "")
    with pytest.raises(ValueError, match="max_nodes >= 1"):
        system.Limits(max_nodes=0)
