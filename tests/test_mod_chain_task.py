"""The length-law task (fspo/data/mod_chain.py) and its per-line reward (fspo/rewards/mod_chain.py)."""
import math
import random

import pytest

from fspo.data.mod_chain import ModChainTask, chain_lines, demonstration, render_prompt
from fspo.rewards.mod_chain import ChainConsistencyReward, line_credit


def test_reference_chain_by_hand():
    assert render_prompt(3, 5) == "Q:3,005\nA:"
    # 3 + 7 = 10 -> 0, 7, 14 -> 4, 11 -> 1, 8
    assert chain_lines(3, 5) == ["005:0", "004:7", "003:4", "002:1", "001:8"]


def test_prompt_length_is_independent_of_the_answer_length():
    t = ModChainTask("train", size=3000, seed=0)
    assert {len(t[i].prompt) for i in range(len(t))} == {10}
    ns = [t[i].meta["n"] for i in range(len(t))]
    assert min(ns) == 4 and max(ns) == 100
    # log-uniform: as many chains of 4..19 lines as of 20..100 (each range is a factor ~5 in n)
    short = sum(n < 20 for n in ns) / len(ns)
    assert short == pytest.approx(math.log(20 / 4) / math.log(101 / 4), abs=0.04)


def test_splits_differ_and_are_deterministic():
    a, b = ModChainTask("train", 50, seed=0), ModChainTask("train", 50, seed=0)
    v = ModChainTask("val", 50, seed=0)
    assert [a[i].prompt for i in range(50)] == [b[i].prompt for i in range(50)]
    assert [a[i].prompt for i in range(50)] != [v[i].prompt for i in range(50)]
    with pytest.raises(ValueError, match="3-digit counter"):
        ModChainTask("train", 5, max_lines=1000)


@pytest.mark.parametrize("text,credit,complete", [
    ("005:0\n004:7\n003:4\n002:1\n001:8", 1.0, True),
    ("005:0\n004:9\n003:6\n002:3\n001:0", 0.8, True),     # one slip: line 2; the rest follow the slipped digit
    ("005:0\n004:7\n003:4", 0.6, False),                  # stops after 3 of 5 lines
    ("005:0\n004:7\n003:4\n002:1\n001:8\n000:5", 5 / 6, False),  # one extra line dilutes
    ("005:0\n004:7\n002:4\n002:1\n001:8", 0.8, True),     # a wrong counter on line 3
    ("005:0\nxx\n003:4\n002:1\n001:8", 0.6, True),        # an unreadable line, and the next has no digit to follow
    ("", 0.0, False),
])
def test_line_credit_by_hand(text, credit, complete):
    assert line_credit(text, 3, 5) == (pytest.approx(credit), complete)


def test_demonstration_slip_rate_and_reward_mean_do_not_depend_on_length():
    rng, reward = random.Random(0), ChainConsistencyReward()
    for n in (4, 100):
        texts = [demonstration(3, n, 0.3, rng) for _ in range(400)]
        out = reward(texts, [f"3,{n}"] * 400, [6 * n] * 400, [False] * 400, 640)
        assert sum(out.scores) / 400 == pytest.approx(0.7, abs=0.03)
        assert out.components["complete"] == [1.0] * 400 and out.errors == 0


def test_bad_reference_scores_zero_and_is_counted():
    out = ChainConsistencyReward()(["005:0"], ["not a ref"], [5], [False], 640)
    assert out.scores == [0.0] and out.errors == 1
