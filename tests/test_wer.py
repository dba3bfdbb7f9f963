"""engine.wer: exact word error counts on small cases, the normalisation, and long texts."""

from __future__ import annotations

import random
import time

import pytest

from engine.wer import corpus_wer, edit_distance, normalize, number_words, wer, word_errors


@pytest.mark.parametrize("reference,hypothesis,errors,words", [
    ("the quick brown fox", "the quick brown fox", 0, 4),
    ("the quick brown fox", "the quick red fox", 1, 4),  # substitution
    ("the quick brown fox", "the brown fox", 1, 4),  # deletion
    ("the quick brown fox", "the very quick brown fox", 1, 4),  # insertion
    ("the quick brown fox", "quick the brown fox", 2, 4),  # a swap is two edits
    ("the quick brown fox", "", 4, 4),
    ("", "hello there", 2, 0),
    ("a b c d e f", "a x c e f g", 3, 6),  # b->x, d deleted, g inserted
])
def test_exact_counts(reference, hypothesis, errors, words):
    assert word_errors(reference, hypothesis) == (errors, words)


def test_rates():
    assert wer("the quick brown fox", "the quick red fox") == 0.25
    assert wer("", "") == 0.0
    assert wer("", "two words") == 2.0
    assert corpus_wer([("a b c d", "a b c d"), ("e f", "e g")]) == pytest.approx(1 / 6)


def test_normalisation():
    assert normalize("The Quick, brown FOX!  Jumps... over?") == "the quick brown fox jumps over".split()
    assert normalize("Don't stop; it's Friday’s report.") == "dont stop its fridays report".split()
    assert wer("Meetings start at nine in the morning.", "Meetings start at 9 in the morning") == 0
    assert normalize("21 twenty-one 1,000 3.5 100 1999") == (
        "twenty one twenty one one thousand three point five one hundred "
        "one thousand nine hundred ninety nine").split()
    assert normalize("50% $5") == ["fifty", "five"]
    assert normalize("1234567") == ["1234567"]  # too long to spell: left as digits
    assert normalize("Guten Morgen, für Sie") == ["guten", "morgen", "für", "sie"]


def test_number_words():
    assert [number_words(n) for n in (0, 13, 40, 99, 101, 110, 1000, 2024, 999_999)] == [
        "zero", "thirteen", "forty", "ninety nine", "one hundred one", "one hundred ten", "one thousand",
        "two thousand twenty four", "nine hundred ninety nine thousand nine hundred ninety nine"]


def _slow_distance(a, b):
    d = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, d[0] = d[0], i
        for j, y in enumerate(b, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (x != y))
    return d[-1]


def test_vectorised_distance_matches_the_textbook_one():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.choice("abcd") for _ in range(rng.randint(0, 12))]
        b = [rng.choice("abcd") for _ in range(rng.randint(0, 12))]
        assert edit_distance(a, b) == _slow_distance(a, b), (a, b)


def test_an_hour_of_words_is_quick():
    rng = random.Random(1)
    words = [rng.choice(["alpha", "beta", "gamma", "delta", "echo"]) + str(i % 7) for i in range(9000)]
    hyp = list(words)
    del hyp[100]  # one deletion
    hyp[5000] = "zulu"  # one substitution
    hyp.insert(8000, "extra")  # one insertion
    start = time.perf_counter()
    assert edit_distance(words, hyp) == 3
    assert time.perf_counter() - start < 20
