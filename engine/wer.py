"""Word error rate: word-level edit distance (substitutions + deletions + insertions) divided by the
number of reference words, after a small, documented normalisation.

Normalisation (the same for the reference and the hypothesis), deliberately simple:

1. Unicode NFKC, lower case.
2. Apostrophes are dropped inside words ("don't" -> "dont", "Friday's" -> "fridays").
3. Numbers written with digits become words, so "9" and "nine" match: "1,000" -> "one thousand",
   "3.5" -> "three point five", "21" -> "twenty one", "1999" -> "one thousand nine hundred ninety
   nine" (no year reading). Whole numbers up to 999,999 are spelled; longer ones stay digits. Hyphens
   split words ("twenty-one" -> "twenty one"). Ordinals ("3rd"), currency and percent signs are not
   spelled out: "$5" is "five", "50%" is "fifty".
4. Every other character that is not a letter or digit separates words (punctuation is removed).

No spelling variants (colour / color), contractions (dont / do not) or fillers are merged; a
transcript that differs only there counts those words as errors.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """0 <= n < 1,000,000 in words: 21 -> 'twenty one', 1000 -> 'one thousand'."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + number_words(n % 100))
    if n < 1_000_000:
        return number_words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + number_words(n % 1000))
    raise ValueError(f"{n} is too large to spell")


def _spell(match: re.Match) -> str:
    digits = match.group(0)
    return f" {number_words(int(digits))} " if len(digits) <= 6 else f" {digits} "


def normalize(text: str) -> list[str]:
    """The words of ``text`` after the normalisation described in the module docstring."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"(?<=\w)['\u2019\u02bc](?=\w)", "", text)  # don't -> dont
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000
    text = re.sub(r"(?<=\d)\.(?=\d)", " point ", text)  # 3.5 -> 3 point 5
    text = re.sub(r"\d+", _spell, text)
    text = re.sub(r"[^\w]|_", " ", text)
    return text.split()


def edit_distance(reference: list[str], hypothesis: list[str]) -> int:
    """Levenshtein distance between two word lists (each substitution, deletion, insertion costs 1).
    One numpy row per reference word, so an hour of speech (~10k words each side) takes a second or so."""
    if not reference or not hypothesis:
        return len(reference) + len(hypothesis)
    vocab: dict[str, int] = {}
    ref = np.array([vocab.setdefault(w, len(vocab)) for w in reference], np.int64)
    hyp = np.array([vocab.setdefault(w, len(vocab)) for w in hypothesis], np.int64)
    m = hyp.size
    steps = np.arange(m + 1, dtype=np.int64)
    prev = steps.copy()  # distances from the empty reference prefix
    row = np.empty(m + 1, np.int64)
    for i, word in enumerate(ref, start=1):
        # deletion (from above) or match / substitution (diagonal); then insertions along the row:
        # row[j] = min over k <= j of (best[k] + j - k), a running minimum of best[k] - k
        row[0] = i
        np.minimum(prev[1:] + 1, prev[:-1] + (hyp != word), out=row[1:])
        np.minimum.accumulate(row - steps, out=row)
        row += steps
        prev, row = row, prev
    return int(prev[m])


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(word errors, reference words) after normalisation."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    return edit_distance(ref, hyp), len(ref)


def wer(reference: str, hypothesis: str) -> float:
    """Word errors / reference words (an empty reference counts every hypothesis word as an error,
    divided by 1)."""
    errors, words = word_errors(reference, hypothesis)
    return errors / max(words, 1)


def corpus_wer(pairs) -> float:
    """Pooled WER of (reference, hypothesis) pairs: all errors / all reference words."""
    errors = words = 0
    for reference, hypothesis in pairs:
        e, w = word_errors(reference, hypothesis)
        errors, words = errors + e, words + w
    return errors / max(words, 1)
