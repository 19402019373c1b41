"""Math reward: extraction, scoring, overlong penalty, hard deadlines on adversarial output."""
from __future__ import annotations

import pickle
import time

import pytest

from fspo.data.math_io import resolve_data_dir
from fspo.rewards.answer_extraction import extract_answer, fast_equal, last_answer_line, last_boxed
from fspo.rewards.math_verify_reward import MathVerifyReward, overlong_penalty

TIMEOUT = 1.0
MARGIN = 1.0  # process kill + replacement on 2 shared CPU cores


@pytest.fixture(scope="module")
def reward():
    r = MathVerifyReward(timeout_s=TIMEOUT, num_workers=2)
    r.pool.start()
    yield r
    r.close()


def score(r, completions, refs, lengths=None, max_new_tokens=100):
    n = len(completions)
    return r(completions, refs, lengths or [1] * n, [False] * n, max_new_tokens)


# ---------------------------------------------------------------- extraction
def test_last_boxed_balanced_and_escaped_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c")[0] == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{1, 2\\}}")[0] == "\\{1, 2\\}"
    assert last_boxed("so \\boxed 7.")[0] == "7."
    assert last_boxed("\\boxed{1} then \\boxed{2") is None  # the last box is unclosed
    assert last_boxed("\\boxed{}") is None and last_boxed("no box") is None
    assert last_boxed("\\boxed{" + "1" * 50 + "}", max_chars=10) is None


def test_answer_line_and_choice_of_the_later_form():
    assert last_answer_line("Answer: 3\nmore\nanswer: 4")[0] == "4"
    assert extract_answer("**Answer:** $\\frac{1}{2}$.") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{5}\nFinal Answer: 6") == "6"
    assert extract_answer("Answer: 5\nActually \\boxed{6}") == "6"
    assert extract_answer("Answer: $x = \\boxed{7}$") == "7"
    assert extract_answer("I think it's 5") is None and extract_answer("Answer:   \n") is None


def test_fast_path_decides_only_safe_cases():
    assert fast_equal("025", "25") and fast_equal("1,000", "1000") and fast_equal("\\dfrac{1}{2}", "\\frac{1}{2}")
    assert fast_equal("10\\%", "10") and fast_equal("5.0", "5")
    assert fast_equal("6", "5") is False
    assert fast_equal("0.5", "\\frac{1}{2}") is None and fast_equal("10\\%", "0.1") is None


# ---------------------------------------------------------------- scoring
def test_boxed_and_answer_forms_right_wrong_missing(reward):
    comps = ["... so the answer is $\\boxed{\\frac{1}{2}}$.", "work\nAnswer: 0.5", "\\boxed{(3, \\pi/2)}",
             "\\boxed{0.6}", "Answer: 1/3", "I give up", "\\boxed{x = 5}"]
    refs = ["0.5", "\\frac12", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{1}{2}", "0.3333", "5", "5"]
    out = score(reward, comps, refs)
    assert out.components["correct"] == [1, 1, 1, 0, 0, 0, 1]
    assert out.components["format"] == [1, 1, 1, 1, 1, 0, 1]
    assert out.scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0] and out.errors == 0
    assert out.components["overlong_penalty"] == [0.0] * 7


def test_hedged_answers_are_not_rewarded(reward):
    comps = ["\\boxed{4 \\text{ or } 5}", "\\boxed{1, 2, 3, 4, 5}", "\\boxed{5 \\lor 4}", "\\boxed{5 \\pm 1}",
             "\\boxed{[0, 10]}", "\\boxed{4} and \\boxed{6}"]
    assert score(reward, comps, ["5"] * len(comps)).scores == [0.0] * len(comps)


def test_configurable_rewards():
    r = MathVerifyReward(correct_reward=1.0, incorrect_reward=-1.0, format_reward=0.1)
    try:
        out = score(r, ["\\boxed{4}", "\\boxed{5}", "none"], ["4", "4", "4"])  # all on the fast path
        assert out.scores == pytest.approx([1.1, -0.9, -1.0])
    finally:
        r.close()


def test_overlong_penalty_hand_computed():
    # max_new_tokens 100, buffer 20 -> expected length 80; penalty = min(0, (80 - L) / 20) * factor
    assert overlong_penalty(50, 100, 20, 1.0) == 0.0
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(95, 100, 20, 0.5) == pytest.approx(-0.375)
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # off
    r = MathVerifyReward(overlong_buffer_len=20, overlong_penalty_factor=1.0)
    try:
        out = score(r, ["\\boxed{4}", "\\boxed{4}", "\\boxed{3}"], ["4"] * 3, lengths=[70, 90, 100])
        assert out.components["overlong_penalty"] == pytest.approx([0.0, -0.5, -1.0])
        assert out.scores == pytest.approx([1.0, 0.5, -1.0])
        with pytest.raises(ValueError, match="overlong_buffer_len \\(20\\) must be <= max_new_tokens \\(10\\)"):
            score(r, ["x"], ["1"], max_new_tokens=10)
    finally:
        r.close()


ADVERSARIAL = {
    "power tower": "\\boxed{2^{2^{2^{100}}}}",
    "9^9^9^9": "so \\boxed{9^{9^{9^{9}}}}",
    "nested exponent fraction":
        "\\boxed{\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}}",
    "deeply nested fractions": "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "}",
    "nested fractions over the length cap": "\\boxed{" + "\\frac{1}{" * 120 + "2" + "}" * 120 + "}",
    "deeply nested parentheses": "\\boxed{" + "(" * 400 + "1" + ")" * 400 + "}",
    "huge factorial": "\\boxed{(10^{10^{10}})!}",
    "100k chars then unclosed box": "x" * 100_000 + "\\boxed{5",
    "100k unbalanced braces": "\\boxed{" + "{" * 100_000,
    "100k boxes": "\\boxed{" * 20_000,
    "100k-char answer line": "Answer: " + "9" * 100_000,
    "long digit string in box": "\\boxed{" + "9" * 900 + "^{" + "9" * 50 + "}}",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_completion_finishes_within_deadline_and_scores_zero(reward, name):
    t0 = time.perf_counter()
    out = score(reward, [ADVERSARIAL[name]], ["5"])
    elapsed = time.perf_counter() - t0
    assert out.scores == [0.0]
    assert elapsed < TIMEOUT + MARGIN, f"{name}: {elapsed:.2f}s"


def test_adversarial_batch_does_not_block_honest_samples(reward):
    comps = [ADVERSARIAL["power tower"], "\\boxed{\\frac{10}{2}}", ADVERSARIAL["9^9^9^9"], "Answer: 5"]
    t0 = time.perf_counter()
    out = score(reward, comps, ["5"] * 4)
    assert out.scores == [0.0, 1.0, 0.0, 1.0]
    assert out.errors == 2 and reward.last_stats["timeout"] == 2
    assert time.perf_counter() - t0 < 2 * (TIMEOUT + MARGIN)


def test_shorter_timeout_is_honoured():
    r = MathVerifyReward(timeout_s=0.3, num_workers=1)
    try:
        r.pool.start()
        t0 = time.perf_counter()
        assert score(r, [ADVERSARIAL["power tower"]], ["5"]).scores == [0.0]
        assert time.perf_counter() - t0 < 0.3 + MARGIN
        assert score(r, ["\\boxed{\\sqrt{4}}"], ["2"]).scores == [1.0]  # the replacement worker works
        assert r.pool.restarts == 1
    finally:
        r.close()


def test_raising_check_scores_zero_and_counts_an_error():
    # operator.truediv raises TypeError on two strings: a real, importable check that always fails.
    r = MathVerifyReward(check="operator:truediv", num_workers=1)
    try:
        out = score(r, ["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "no answer"], ["0.5", "3", "1"])
        assert out.scores == [0.0, 1.0, 0.0]  # the second is decided by the fast path
        assert out.errors == 1 and r.last_stats["error"] == 1
    finally:
        r.close()


def test_non_string_completion_is_an_error_not_a_crash(reward):
    out = score(reward, [None, "\\boxed{5}"], ["5", "5"])
    assert out.scores == [0.0, 1.0] and out.errors == 1


def test_bad_inputs_and_config():
    r = MathVerifyReward()
    with pytest.raises(ValueError, match="reward inputs differ in length"):
        r(["a", "b"], ["1"], [1, 1], [False, False], 10)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        MathVerifyReward(timeout_s=0)
    with pytest.raises(ValueError, match="module:function"):
        MathVerifyReward(check="no_colon")


def test_reward_pickles_without_its_workers(reward):
    clone = pickle.loads(pickle.dumps(reward))
    try:
        assert clone._pool is None and score(clone, ["\\boxed{2}"], ["2"]).scores == [1.0]
    finally:
        clone.close()


# ---------------------------------------------------------------- agreement with the references
@pytest.mark.slow
@pytest.mark.skipif(not (resolve_data_dir(None) / "math500_test.jsonl").is_file(), reason="math data not found")
def test_reference_agreement_on_all_eval_sets(reward):
    """Full run of benchmarks/verify_agreement.py's check (about 10 s): every reference written as
    \\boxed{REF} and 'Answer: REF' is correct, another row's answer is not."""
    import verify_agreement as mod  # benchmarks/ is on pytest's path (pyproject's pythonpath)
    total = agree = 0
    for name in ("math500", "aime24", "aime25", "gsm8k"):
        res = mod.agreement(name, reward)
        total, agree = total + res["checks"], agree + res["agree"]
        assert res["agreement_pct"] >= 99.0, (name, res["failures"][:5])
    assert 100.0 * agree / total >= 99.5
