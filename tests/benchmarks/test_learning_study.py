"""The learning study's pure helpers: held-out curve points and the fixed/broken test queries."""

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from joyagents_jax import config_checks

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "learning_study.py"
_SPEC = importlib.util.spec_from_file_location("learning_study", _PATH)
ls = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ls)


def _run(evals, final_tokens, final_acc):
    """A cached run whose curve has one point per step; evals: {step: accuracy}."""
    steps = final_tokens // 100
    curve = [{"step": k, "tokens": 100 * k, **({"test_acc_no_memory": evals[k]} if k in evals
                                               else {})} for k in range(1, steps + 1)]
    return {"curve": curve, "generated_tokens": 100 * steps, "test_acc_no_memory": final_acc}


def test_heldout_points_end_at_the_final_evaluation_past_the_last_eval_every():
    run = _run({2: 0.6, 4: 0.7}, final_tokens=500, final_acc=0.65)
    assert ls.heldout_points(run, 0.5) == [(0, 0.5), (200, 0.6), (400, 0.7), (500, 0.65)]


def test_heldout_points_do_not_repeat_an_evaluation_at_the_last_step():
    run = _run({2: 0.6, 4: 0.7}, final_tokens=400, final_acc=0.7)
    assert ls.heldout_points(run, None) == [(200, 0.6), (400, 0.7)]


def test_heldout_points_are_sft_and_the_final_evaluation_without_evaluations_along_the_way():
    assert ls.heldout_points(_run({}, final_tokens=300, final_acc=0.6), 0.5) == [(0, 0.5),
                                                                                 (300, 0.6)]
    assert ls.heldout_points(_run({}, final_tokens=300, final_acc=0.6), None) == [(300, 0.6)]


@pytest.mark.parametrize("after,before,expected", [
    ([1, 0, 1, 0], [0, 0, 1, 1], (1, 1)),
    ([1, 1], [1, 1], (0, 0)),
])
def test_flips_count_fixed_and_broken_queries(after, before, expected):
    assert ls.flips({"test_answers_no_memory": after},
                    {"test_answers_no_memory": before}) == expected


@pytest.mark.parametrize("wins,losses,expected", [(0, 0, 1.0), (3, 3, 1.0), (5, 0, 0.0625),
                                                  (0, 5, 0.0625), (9, 1, 0.021484375)])
def test_sign_test_p_is_the_two_sided_binomial_tail(wins, losses, expected):
    assert ls.sign_test_p(wins, losses) == pytest.approx(expected)


def test_paired_sums_wins_and_losses_over_the_seeds_both_runs_hold():
    answers = lambda seed, xs: {"seed": seed, "test_answers_no_memory": xs}
    runs = [answers(0, [1, 1, 0]), answers(1, [1, 0, 0]), answers(2, [1, 1, 1])]
    base = [answers(1, [0, 1, 0]), answers(0, [0, 1, 1]), answers(3, [0, 0, 0])]
    assert ls.paired(runs, base) == ([0, 1], 2, 2)
    assert ls.paired(runs, [answers(5, [1, 1, 1])]) is None


def test_paired_and_records_match_runs_of_one_device_only():
    run = lambda device, xs: {"seed": 0, "device": device, "test_answers_no_memory": xs}
    assert ls.paired([run("cpu: A", [1, 1])], [run("cpu: B", [0, 0])]) is None
    assert ls.paired([run("cpu: A", [1, 1])], [run("cpu: B", [0, 0]), run("cpu: A", [1, 0])]) \
        == ([0], 1, 0)
    full = lambda variant, device, acc: {
        "variant": variant, "seed": 0, "device": device, "test_acc": acc,
        "test_acc_no_memory": acc, "llm_calls_no_memory": 4.0, "generated_tokens": 10,
        "steps": 1, "test_answers_no_memory": [acc]}
    recs = ls.records([full("sft_only", "cpu: B", 0.0), full("default", "cpu: A", 1.0)])
    assert recs[1]["sft_test_acc"] is None and recs[1]["device"] == "cpu: A"
    recs = ls.records([full("sft_only", "cpu: A", 0.0), full("default", "cpu: A", 1.0)])
    assert (recs[1]["sft_test_acc"], recs[1]["fixed_no_memory"]) == (0.0, 1)


def test_paired_table_rows_name_variant_baseline_and_net_points():
    answers = lambda seed, xs: {"seed": seed, "test_answers_no_memory": xs + [0] * (200 - len(xs))}
    by_variant = {"default": [answers(0, [1] * 10)], "trajectory": [answers(0, [0] * 10)],
                  "sft_only": [answers(0, [])]}
    rows = ls.paired_table(by_variant).splitlines()[2:]
    assert rows == ["| default | trajectory | 0 | 10 / 0 | +5.0 | 0.002 |"]
    assert ls.paired_table({"default": by_variant["default"]}) == ""


def test_against_table_compares_each_variant_with_the_reference_roots_runs():
    def run(seed, xs, device="cpu"):
        answers = xs + [0] * (200 - len(xs))
        return {"seed": seed, "device": device, "test_answers_no_memory": answers,
                "test_acc_no_memory": sum(answers) / 200}
    screen = {"default": [run(0, [1] * 10), run(1, [1] * 4)], "sft_only": [run(0, [])]}
    reference = {"default": [run(0, [1] * 6), run(1, [0] * 4 + [1] * 2, "gpu")],
                 "trajectory_replay": [run(0, [0] * 10), run(1, [1] * 2)]}
    rows = ls.against_table(screen, reference).splitlines()[2:]
    # Seed 1's reference default ran on another device: only seed 0 pairs with it.
    assert rows == ["| default | default | 0 | 0.050 / 0.030 | 4 / 0 | +2.0 | 0.125 |",
                    "| default | trajectory_replay | 0,1 | 0.035 / 0.005 | 12 / 0 | +3.0 | 0.000 |"]
    assert ls.against_table(screen, {"nodewise_all": [run(5, [])]}) == ""


def test_against_a_folder_without_runs_is_refused_by_name(tmp_path):
    got = subprocess.run([sys.executable, str(_PATH), "--root", str(tmp_path / "screen"),
                          "--report", "--against", str(tmp_path / "typo")],
                         capture_output=True, text=True)
    assert got.returncode == 1
    assert f"--against {tmp_path / 'typo'}: no result_<variant>_s<seed>.json there" in got.stderr
    assert not (tmp_path / "screen").exists()


def test_domain_table_gives_accuracy_alone_and_wins_per_domain():
    run = lambda seed, xs, device="cpu": {"seed": seed, "device": device,
                                          "test_answers_no_memory": xs}
    domains = ["math", "math", "qa", "qa"]
    by_variant = {"sft_only": [run(0, [0, 0, 0, 0])],
                  "default": [run(0, [1, 1, 0, 1]), run(1, [1, 0, 0, 0])],
                  "trajectory": [run(0, [0, 1, 1, 1]), run(1, [1, 0, 0, 0], "gpu")]}
    acc, won_lost = ls.domain_table(by_variant, domains, baselines=("trajectory",)).split("\n\n")
    assert acc.splitlines() == [
        "| variant | seeds | math (2) | qa (2) |", "|---|---|---|---|",
        "| sft_only | 0 | 0.000 | 0.000 |", "| default | 0,1 | 0.750 | 0.250 |",
        "| trajectory | 0,1 | 0.500 | 0.500 |"]
    # Seed 1's trajectory run is of another device: only seed 0 pairs up.
    assert won_lost.splitlines()[2:] == ["| default | trajectory | 0 | 1 / 0 | 0 / 1 |"]
    assert ls.domain_table({"default": [run(0, [])]}, domains) == ""


def test_question_flips_count_each_question_once_by_its_net_flips():
    qid = ["a", "a", "a", "b", "b", "c", "d"]
    run = {"test_answers_no_memory": [1, 1, 1, 1, 0, 0, 1]}
    base = {"test_answers_no_memory": [0, 0, 0, 0, 1, 1, 1]}
    assert ls.question_flips(run, base, qid) == (1, 1)  # a won, b even, c lost, d unchanged
    assert ls.question_flips(run, {}, qid) is None


def test_paired_over_questions_sums_questions_over_seeds():
    qid = ["a", "a", "b"]
    answers = lambda seed, xs: {"seed": seed, "test_answers_no_memory": xs}
    runs = [answers(0, [1, 1, 0]), answers(1, [0, 0, 1])]
    base = [answers(0, [0, 0, 1]), answers(1, [1, 1, 0])]
    assert ls.paired(runs, base) == ([0, 1], 3, 3)
    assert ls.paired(runs, base, qid) == ([0, 1], 2, 2)


def test_paired_table_adds_the_question_columns_given_the_questions():
    answers = lambda seed, xs: {"seed": seed, "test_answers_no_memory": xs + [0] * (200 - len(xs))}
    by_variant = {"default": [answers(0, [1] * 10)], "trajectory": [answers(0, [0] * 10)]}
    qid = ["a"] * 6 + [f"q{i}" for i in range(194)]
    head, _, row = ls.paired_table(by_variant, qid).splitlines()
    assert head.endswith("| questions won / lost | sign test p over questions |")
    assert row == "| default | trajectory | 0 | 10 / 0 | +5.0 | 0.002 | 5 / 0 | 0.062 |"


def test_question_spread_equals_the_seed_spread_when_one_question_moves():
    # Queries a, a, b, c: the seeds differ only in question a (both of its records).
    sd, sd_q = ls.question_spread(np.array([[1, 1, 0, 1], [0, 0, 0, 1]], float), list("aabc"))
    np.testing.assert_allclose([sd, sd_q], [0.5 / np.sqrt(2)] * 2)


def test_question_spread_is_below_the_seed_spread_when_every_question_moves_together():
    # A seed-wide level: per-question variation would give sqrt(4 * 0.5 + 0.5 + 0.5) / 4.
    sd, sd_q = ls.question_spread(np.array([[1, 1, 1, 1], [0, 0, 0, 0]], float), list("aabc"))
    np.testing.assert_allclose([sd, sd_q], [np.sqrt(0.5), np.sqrt(3) / 4])


def test_spread_table_needs_two_seeds_of_one_device():
    run = lambda seed, xs, device="cpu": {"seed": seed, "device": device,
                                          "test_answers_no_memory": xs}
    by_variant = {"default": [run(0, [1, 1, 0, 1]), run(1, [0, 0, 0, 1])],
                  "trajectory": [run(0, [1, 0, 0, 0])],
                  "nodewise_all": [run(0, [1, 0, 0, 0]), run(1, [1, 1, 0, 0], "gpu")]}
    lines = ls.spread_table(by_variant, list("aabc")).splitlines()
    assert lines[2:] == ["| default | 0,1 | 35.36 | 35.36 |"]
    assert ls.spread_table({"trajectory": by_variant["trajectory"]}, list("aabc")) == ""


def test_flips_need_both_runs_answers():
    assert ls.flips({"test_answers_no_memory": [1.0]}, None) is None


def test_call_moves_count_queries_with_more_and_fewer_calls():
    assert ls.call_moves({"test_calls_no_memory": [4, 3, 5, 4]},
                         {"test_calls_no_memory": [3, 3, 6, 4]}) == (1, 1)


def test_call_moves_need_both_runs_calls():
    assert ls.call_moves({"test_calls_no_memory": [4]}, {"test_answers_no_memory": [1.0]}) is None


def test_calls_against_minimum_split_redundant_calls_from_early_ends():
    above, below = ls.calls_against_minimum({"test_calls_no_memory": [5, 3, 4, 7],
                                             "test_min_calls": [4, 4, 4, 7]})
    assert (above, below) == (0.25, 0.25)


def test_calls_against_minimum_need_the_minimum():
    assert ls.calls_against_minimum({"test_calls_no_memory": [5]}) is None


def test_parse_overrides_reads_numbers_booleans_in_any_case_and_strings():
    assert ls.parse_overrides(["grpo.topk=2", "grpo.query_power=0.5", "grpo.mode=trajectory",
                               "grpo.gold_branches=true", "memory.enabled=False",
                               "eval.splits=('test',)"]) == {
        "grpo.topk": 2, "grpo.query_power": 0.5, "grpo.mode": "trajectory",
        "grpo.gold_branches": True, "memory.enabled": False, "eval.splits": ("test",)}


def test_sft_overrides_keep_what_changes_the_sft_phase():
    assert ls.sft_overrides({"max_len": 384, "sft.demo_redundant_call": 0.0, "grpo.topk": 1,
                             "memory.enabled": False}) == {"max_len": 384,
                                                           "sft.demo_redundant_call": 0.0}


def test_conflicts_name_keys_set_twice_to_different_values():
    assert ls.conflicts("sft_clean", {"max_len": 512, "sft.demo_redundant_call": 0.0,
                                      "grpo.topk": 1}) == ["max_len"]
    assert ls.conflicts("default", {"max_len": 512}) == []


def test_only_variants_with_sft_overrides_train_their_own_sft_checkpoint(tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(ls.train, "train", lambda c, workdir: trained.append((c, workdir)))
    root, steps = str(tmp_path), ls.config_for(0, {}).sft.steps
    (tmp_path / "sft_s1" / "checkpoints" / str(steps)).mkdir(parents=True)
    assert ls.sft_checkpoint(root, 1, "data", {"grpo.topk": 1}) == str(tmp_path / "sft_s1")
    assert not trained  # its end-of-SFT checkpoint exists
    workdir = ls.sft_checkpoint(root, 1, "data", ls.VARIANTS["sft_clean"][1], "sft_clean")
    assert workdir == str(tmp_path / "sft_sft_clean_s1")
    (c, where), = trained
    assert where == workdir
    assert (c.seed, c.max_len, c.sft.demo_redundant_call, c.grpo.steps) == (1, 384, 0.0, 0)


def test_variant_colors_are_distinct_past_the_ten_colour_cycle():
    names = list(ls.VARIANTS)[:12]
    colors = ls.variant_colors(names)
    assert list(colors) == names
    assert len(set(colors.values())) == 12
    assert len(set(ls.variant_colors(names[:3]).values())) == 3


def test_study_figure_labels_token_ticks_in_thousands_on_both_panels():
    runs = {"sft_only": [{"seed": 0, "test_acc": 0.5, "curve": []}],
            "default": [{"seed": 0, "generated_tokens": 350_000, "test_acc_no_memory": 0.72,
                         "curve": [{"tokens": 70_000 * k, "accuracy": 0.5 + 0.05 * k,
                                    **({"test_acc_no_memory": 0.6} if k == 2 else {})}
                                   for k in range(1, 6)]},
                        {"seed": 1, "generated_tokens": 200_000, "test_acc_no_memory": 0.7,
                         "curve": [{"tokens": 100_000 * k, "accuracy": 0.6} for k in (1, 2)]}]}
    fig = ls.study_figure(runs)
    fig.canvas.draw()
    rollout_ax, heldout_ax = fig.axes
    for ax in (rollout_ax, heldout_ax):
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(len(text) <= 5 for text in labels), labels
    assert heldout_ax.xaxis.get_major_formatter()(350_000) == "350k"
    assert len(rollout_ax.lines) == 2
    # Seed 0 evaluated along the way: solid from SFT; seed 1 (no SFT run) only at its end.
    assert [(line.get_linestyle(), len(line.get_xdata())) for line in heldout_ax.lines] == [
        ("-", 3), (":", 1)]


@pytest.mark.parametrize("name", list(ls.VARIANTS))
def test_every_variant_is_a_valid_config(name):
    """A variant whose overrides the config checks refuse would fail only after its SFT."""
    assert config_checks.problems(ls.config_for(0, ls.VARIANTS[name][1])) == []


def test_popularity_table_splits_fixed_and_broken_queries_by_the_questions_train_records():
    import collections
    qid = ["a", "a", "b", "c"]
    train = collections.Counter({"a": 30, "b": 2, "c": 25})
    sft = lambda s: {"variant": "sft_only", "seed": s, "test_answers_no_memory": [1, 1, 0, 1]}
    run = lambda s, ans: {"variant": "default", "seed": s, "test_answers_no_memory": ans}
    runs = [sft(0), sft(1), run(0, [0, 0, 1, 1]), run(1, [1, 1, 1, 0])]
    table = ls.popularity_table(runs, qid, train)
    assert "3 of 4 test queries" in table
    assert table.splitlines()[-1] == "| default | 2 | 0 / 3 | 2 / 0 | -1 |"
    assert ls.popularity_table([sft(0)], qid, train) == ""
