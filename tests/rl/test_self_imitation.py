"""Self-imitation's draw from the memory tables: which entries qualify, how many, determinism."""

import jax
import numpy as np

from joyagents_jax.rl import memory, self_imitation

CFG = memory.MemoryConfig(capacity=6, response_length=4, request_length=2, prompt_length=5)
BEST = 1.1


def table(rows):
    """A host table of rows (reward, prompt length, response length[, valid]) in slots 0, 1, ...;
    slot i's prompt tokens are 100 + i, its response tokens 200 + i."""
    t = jax.tree.map(np.array, memory.init_table(CFG, 3))  # writable host copies
    for i, (reward, plen, rlen, *valid) in enumerate(rows):
        t.prompt[i], t.prompt_length[i] = 100 + i, plen
        t.response[i], t.length[i] = 200 + i, rlen
        t.reward[i], t.valid[i] = reward, valid[0] if valid else True
    return t


def test_eligible_entries_are_valid_best_whole_and_fit_max_len():
    t = table([(np.float32(BEST), 3, 2),  # qualifies
               (1.0, 3, 2),  # below the best reward
               (BEST, 3, 2, False),  # an empty (or deleted) slot
               (BEST, 6, 2),  # prompt longer than the 5 kept tokens
               (BEST, 5, 4),  # prompt + response 9 > max_len 8
               (BEST, 5, 3)])  # exactly max_len
    np.testing.assert_array_equal(self_imitation.eligible(t, BEST, max_len=8), [0, 5])


def test_draw_takes_up_to_n_distinct_entries_per_agent_in_agent_order():
    tables = {"qa": table([(BEST, 2, 1)] * 5), "math": table([(BEST, 3, 2)]),
              "efc": table([(1.0, 2, 1)])}
    demos = self_imitation.draw(tables, ["math", "qa", "efc"], 3, BEST, 8,
                                np.random.default_rng(0))
    assert [a for a, _, _ in demos] == ["math", "qa", "qa", "qa"]
    assert demos[0] == ("math", [100, 100, 100], [200, 200])
    slots = [p[0] - 100 for a, p, _ in demos if a == "qa"]
    assert len(set(slots)) == 3
    for agent, prompt, response in demos[1:]:
        slot = prompt[0] - 100
        assert prompt == [100 + slot] * 2 and response == [200 + slot]


def test_draw_is_a_function_of_the_generator_seed():
    tables = {"qa": table([(BEST, 2, 1)] * 6)}
    draw = lambda seed: self_imitation.draw(tables, ["qa"], 2, BEST, 8,
                                            np.random.default_rng([0, 13, seed]))
    assert draw(4) == draw(4)
    assert len({tuple(p[0] for _, p, _ in draw(s)) for s in range(8)}) > 1


def test_nothing_eligible_draws_nothing():
    tables = {"qa": table([])}
    assert self_imitation.draw(tables, ["qa"], 4, BEST, 8, np.random.default_rng(0)) == []
