"""Answer extraction, grading (fast path + math-verify with a hard timeout), reward functions."""

import time

import pytest

from reward import Grader, RewardFunctions, extract_answer, extract_boxed, fast_match
from reward import format_reward, normalize


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested \\boxed{\\sqrt{x^{2}}} end", "\\sqrt{x^{2}}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed 5", "5"),
    ("so it is \\boxed 5.", "5"),
    ("$\\boxed 7$.", "7"),
    ("\\fbox{9}", "9"),
    ("no box here, the answer is 3", None),
    ("unclosed \\boxed{12", None),
    ("\\boxed{a} and broken \\boxed{b", "a"),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("The answer is 85.", "85"),
    ("The answer is: 1,234", "1,234"),
    ("47 + 38 = 85", "85"),
    ("I think the answer is -3 and not 4", "-3"),
    ("The answer is 3? No, the answer is 5, not 6.", "5"),  # the last "answer is"
    ("The answer is <number>.", None),
    ("no numbers", None),
])
def test_extract_answer_is(text, expected):
    assert extract_answer(text, "answer-is") == expected


# (prediction, gold, correct?) -- at least 30 tricky pairs.
PAIRS = [
    ("1/2", "\\frac{1}{2}", True),
    ("\\frac12", "1/2", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("0.5", "\\frac{1}{2}", True),
    ("2/4", "1/2", True),
    ("1/3", "0.33", False),
    ("5 \\text{ cm}", "5", True),
    ("10\\text{ inches}", "10", True),
    ("90^\\circ", "90", True),
    ("45^{\\circ}", "45", True),
    ("\\$18", "18", True),
    ("$18.00", "18", True),
    ("1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("12,345,678", "12345678", True),
    ("007", "7", True),
    ("7.0", "7", True),
    ("-3", "-3", True),
    ("-3", "3", False),
    ("x = 5", "5", True),
    ("50\\%", "50", True),
    ("\\sqrt{2}", "\\sqrt2", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\pi", "3.14", False),
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("(1, 2)", "(1,2)", True),
    ("x^2 + 2x + 1", "(x+1)^2", True),
    ("\\{1, 2\\}", "\\{2, 1\\}", True),
    ("\\left( 3, 4 \\right)", "(3,4)", True),
    ("\\boxed{3}", "4", False),
    ("12", "13", False),
    ("", "1", False),
    ("10^{2}", "100", True),
    ("e", "2.71828", False),
    ("5.", "5", True),
    ("1,2", "12", False),
    ("(1,2)", "12", False),
    ("0.1", "1/10", True),
    ("-0.5", "-1/2", True),
]


def test_grader_on_tricky_pairs():
    grader = Grader(workers=2, timeout=10)
    try:
        got = grader.grade([p for p, _, _ in PAIRS], [g for _, g, _ in PAIRS])
    finally:
        grader.close()
    wrong = [(p, g, want) for (p, g, want), ok in zip(PAIRS, got) if ok != want]
    assert not wrong, wrong
    assert len(PAIRS) >= 30


def test_none_prediction_is_wrong():
    assert Grader().grade([None], ["1"]) == [False]


def test_hostile_answer_times_out_quickly():
    grader = Grader(workers=1, timeout=1.0)
    hostile = "9^{9^{9^{9^{9^{9}}}}}-9^{9^{9^{9^{9^{9}}}}}+" * 20 + "1"
    try:
        grader.grade(["1/2"], ["\\frac{1}{2}"])  # warm the worker up (spawn + import)
        t0 = time.time()
        got = grader.grade([hostile, "\\sqrt{4}"], ["\\frac{\\pi}{7}", "2"])
        elapsed = time.time() - t0
    finally:
        grader.close()
    assert got[0] is False
    assert got[1] is True  # the item after the hostile one is still graded
    assert elapsed < 15, elapsed


def test_reward_functions_weights_and_user_errors(capsys):
    fns = RewardFunctions("correctness,format=0.5", "answer-is", Grader())
    completions = ["The answer is 5.", "It is 6", "bla"]
    rows = [{"answer": "5"}, {"answer": "5"}, {"answer": "5"}]
    total, per_fn = fns(["q"] * 3, completions, None, rows)
    assert per_fn["correctness"] == [1.0, 0.0, 0.0]
    assert per_fn["format"] == [1.0, 0.0, 0.0]
    assert total == [1.5, 0.0, 0.0]

    broken = RewardFunctions("tests.test_reward:_broken_reward,correctness", "answer-is", Grader())
    for _ in range(2):
        total, per_fn = broken(["q"] * 3, completions, None, rows)
    assert per_fn["tests.test_reward:_broken_reward"] == [0.0, 0.0, 0.0]
    assert total == [1.0, 0.0, 0.0]  # the other function still counts
    assert broken.errors == 2
    out = capsys.readouterr().out
    assert out.count("Traceback") == 1  # reported once, with its traceback
    assert "ZeroDivisionError" in out


def _broken_reward(prompts, completions, **fields):
    return [1 / 0 for _ in completions]


def test_user_reward_gets_row_fields():
    fns = RewardFunctions("tests.test_reward:_length_reward", "boxed", Grader())
    total, _ = fns(["q", "q"], ["ab", "abcd"], None, [{"answer": "1", "target": 2},
                                                      {"answer": "1", "target": 4}])
    assert total == [1.0, 1.0]


def _length_reward(prompts, completions, target, **fields):
    return [float(len(c) == t) for c, t in zip(completions, target)]


def _wants_the_prompt_column(prompt, completions, **fields):
    return [0.0 for _ in completions]


def test_the_start_up_check_passes_what_the_call_passes():
    """A parameter named after the data's `prompt` column passed the start-up check, and then
    failed every batch: the call passes that column as `prompts` only (as TRL does)."""
    with pytest.raises(SystemExit, match="takes `prompt`: the prompts are passed as `prompts`"):
        RewardFunctions("tests.test_reward:_wants_the_prompt_column", "boxed", Grader(),
                        columns={"prompt", "answer"})
    # What the check accepts, the call can fill.
    fns = RewardFunctions("tests.test_reward:_length_reward", "boxed", Grader(),
                          columns={"prompt", "answer", "target"})
    assert fns(["q"], ["ab"], None, [{"prompt": "q", "answer": "1", "target": 2}])[0] == [1.0]


def test_unknown_reward_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown reward"):
        RewardFunctions("corectness", "boxed", Grader())


def test_format_reward():
    assert format_reward(None, ["\\boxed{1}", "1"], answer_format="boxed") == [1.0, 0.0]


@pytest.mark.parametrize("text, expected", [
    ("The answer is 85, since 47 + 38 = 85.", "85"),
    ("47 + 38 = 85, so that is it", "85"),
    ("The answer is 1,000, since 10 x 100 = 1,000.", "1,000"),
    ("The answer is 85; done", "85"),
    ("The answer is (85).", "85"),
    ("The answer is $85$.", "85"),
    ("The answer is 85!", "85"),
    ("The answer is 3.5.", "3.5"),
    ("The answer is 12,34", "12"),
    ("The answer is 1,0000", "1"),
    ("The answer is: 85%.", "85"),
])
def test_answer_is_ignores_punctuation_around_numbers(text, expected):
    assert extract_answer(text, "answer-is") == expected


def test_answer_is_with_a_trailing_comma_is_graded_right():
    grader = Grader()
    preds = [extract_answer(t, "answer-is") for t in ("The answer is 85, since 47 + 38 = 85.",
                                                      "The answer is 1,000, since")]
    assert grader.grade(preds, ["85", "1000"]) == [True, True]


@pytest.mark.parametrize("pred, gold, ok", [
    ("2m", "2", False), ("2", "2m", False), ("5g", "5", False), ("5", "5g", False),
    ("3x", "3", False),
    ("5 \\text{ g}", "5", True), ("5\\text{cm}", "5", True), ("5 cm", "5", True),
    ("12 square units", "12", True), ("12\\text{ square units}", "12", True),
    ("5\\ cm", "5", True), ("7", "7 \\text{ meters}", True),
])
def test_units_are_stripped_only_where_they_are_clearly_units(pred, gold, ok):
    grader = Grader(timeout=10)
    try:
        assert grader.grade([pred], [gold]) == [ok]
    finally:
        grader.close()


def _burn():
    while True:
        pass


def test_grader_cold_start_and_a_timeout_do_not_cost_correct_answers():
    """On a busy machine, spawning a worker and importing math-verify takes seconds: none of that
    may count against an item's timeout, and killing a hostile item must not make the items after
    it start cold."""
    import multiprocessing as mp
    hogs = [mp.get_context("spawn").Process(target=_burn, daemon=True) for _ in range(3)]
    for h in hogs:
        h.start()
    grader = Grader(workers=2, timeout=1.0)
    hostile = "9^{9^{9^{9^{9^{9}}}}}-9^{9^{9^{9^{9^{9}}}}}+" * 20 + "1"
    try:
        assert grader.grade(["\\sqrt{4}"], ["2"]) == [True]  # fresh grader: a cold start
        got = grader.grade([hostile, "\\sqrt{4}", "\\sqrt{9}", "\\frac{6}{\\sqrt{4}}"],
                           ["\\frac{\\pi}{7}", "2", "3", "3"])
        assert got == [False, True, True, True]
        assert grader.timeouts <= 1  # the hostile item (it may also fail to parse in time)
        assert grader.grade(["\\sqrt{16}"], ["4"]) == [True]  # right after the kill
    finally:
        grader.close()
        for h in hogs:
            h.kill()


def _inf_reward(prompts, completions, **fields):
    return [float("inf")] + [1.0] * (len(completions) - 1)


def _nan_reward(prompts, completions, **fields):
    return [float("nan")] * len(completions)


def test_a_non_finite_reward_counts_as_an_error(capsys):
    fns = RewardFunctions("tests.test_reward:_inf_reward,tests.test_reward:_nan_reward=0.5,"
                          "correctness", "answer-is", Grader())
    rows = [{"answer": "5"}] * 2
    for _ in range(2):
        total, per_fn = fns(["q"] * 2, ["The answer is 5.", "6"], None, rows)
        assert total == [1.0, 0.0]  # both functions score 0; correctness still counts
    assert per_fn["tests.test_reward:_inf_reward"] == [0.0, 0.0]
    assert fns.errors == 4
    out = capsys.readouterr().out
    assert out.count("Traceback") == 2 and "non-finite score" in out  # each reported once


def test_require_think_close():
    fns = RewardFunctions("correctness", "boxed", Grader(), require_think_close=True)
    completions = ["<think>maybe \\boxed{4}</think> so \\boxed{5}",
                   "<think>still thinking \\boxed{5}",
                   "<think>x</think> \\boxed{4}"]
    total, _ = fns(["q"] * 3, completions, None, [{"answer": "5"}] * 3)
    assert total == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("pred, gold, verdict", [
    ("0.1", "1/10", True),  # exact decimals, not binary floats
    ("-0.5", "-1/2", True),
    ("\\frac{1}{2}", "0.5", True),  # both sides normalised
    ("\\dfrac{3}{4}", "\\frac34", True),
    ("1,000", "1000", True),
    ("12", "13", False),
    ("\\sqrt{2}", "1.41", None),  # needs a symbolic check
])
def test_fast_match_decides_what_it_can(pred, gold, verdict):
    assert fast_match(pred, gold) is verdict


def test_normalize():
    assert normalize("5.") == "5"
    assert normalize("$1,234$") == "1234"
    assert normalize("1,2") == "1,2"  # a list, not a thousands separator
    assert normalize("x = \\frac{1}{2}") == "1/2"


OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"  # a terminal's clipboard write


def _quotes_the_completion(prompts, completions, **fields):
    raise ValueError(f"cannot score {completions[0]}")


def test_data_and_completions_in_a_reward_message_reach_the_terminal_escaped(capsys):
    """A column name from the data in a refusal, a completion in a reward function's error (a
    model may write an escape sequence): shown as text (ESC as \\x1b), never obeyed."""
    with pytest.raises(SystemExit) as stop:
        RewardFunctions("tests.test_reward:_length_reward", "boxed", Grader(),
                        columns={"answer", f"{OSC52}\nx"})
    said = str(stop.value)
    assert said.isprintable() and "'\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\nx'" in said
    fns = RewardFunctions("tests.test_reward:_quotes_the_completion", "boxed", Grader())
    fns(["q"], [f"{OSC52} 5"], None, [{"answer": "5"}])
    out = capsys.readouterr().out
    assert "cannot score \\x1b]52;c;ZWNobyBwd25lZA==\\x07 5" in out
    assert all(line.isprintable() for line in out.splitlines())
