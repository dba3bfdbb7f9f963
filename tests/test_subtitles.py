"""Subtitles that read well: on every cue of an hour-long transcript, lines and characters within the
rules, each cue on screen between the shortest and longest time, cues apart and in order, no word
lost or repeated, and times that stay with the words (no drift) however long the file."""

import dataclasses
import re

import pytest

from app.cli import main as cli_main
from engine import TranscribeRequest
from engine.errors import RequestError
from engine.formats import render
from engine.subtitles import SubtitleRules, cues, wrap
from engine.transcript import Transcript, Word


@pytest.fixture(scope="module")
def hour(engine4, speech):
    """A real transcript (with words) of 45 s of speech, laid end to end 80 times: about an hour."""
    one = engine4.submit(TranscribeRequest(speech["long"], timestamps=True, words=True)).result(600)
    segments = []
    for k in range(80):
        shift = k * one.duration
        for s in one.segments:
            words = [Word(w.start + shift, w.end + shift, w.text, w.probability) for w in s.words]
            segments.append(dataclasses.replace(s, start=s.start + shift, end=s.end + shift, words=words))
    return Transcript("hour.wav", "", "en", 80 * one.duration, segments, {})


def _check(transcript, rules, timed_by_words: bool):
    result = cues(transcript, rules)
    words = [w for s in transcript.segments for w in (s.words or []) if w.text.strip()]
    assert [w for c in result for line in c.lines for w in line.split()] == \
        [w for s in transcript.segments for w in s.text.split()]  # every word once, in order
    at = 0
    for i, cue in enumerate(result):
        assert 1 <= len(cue.lines) <= rules.max_lines and all(len(line) <= rules.max_chars for line in cue.lines)
        assert rules.min_duration - 1e-9 <= cue.end - cue.start <= rules.max_duration + 1e-9
        if i:
            assert cue.start >= result[i - 1].end + rules.min_gap - 1e-9
        if timed_by_words:  # a cue starts with its first word (or just after the cue before it): no drift
            first = words[at]
            assert first.start - 1e-9 <= cue.start <= max(first.start, result[i - 1].end + rules.min_gap) + 1e-9
            at += sum(len(line.split()) for line in cue.lines)
    assert result[-1].end <= transcript.duration + rules.min_duration
    return result


def test_rules_hold_on_every_cue_of_an_hour(hour):
    default = _check(hour, SubtitleRules(), timed_by_words=True)
    assert len(default) > 400 and max(len(line) for c in default for line in c.lines) > 30  # lines are used
    narrow = SubtitleRules(max_chars=24, max_lines=1, min_duration=1.2, max_duration=3.0)
    _check(hour, narrow, timed_by_words=True)
    without_words = dataclasses.replace(hour, segments=[dataclasses.replace(s, words=None) for s in hour.segments])
    _check(without_words, SubtitleRules(), timed_by_words=False)
    srt = render(hour, "srt", narrow)
    blocks = srt.strip().split("\n\n")
    assert len(blocks) == len(cues(hour, narrow)) and all(len(b.split("\n")) == 3 for b in blocks)
    assert re.match(r"1\n00:00:00,\d{3} --> 00:00:0\d,\d{3}\n", srt)


def test_lines_are_balanced_and_break_after_punctuation():
    assert wrap("Please remember to send the quarterly report to the finance team".split(), 42, 2) == \
        ["Please remember to send the quarterly", "report to the finance team"]
    assert wrap("Yes, we will review the budget numbers".split(), 42, 2) == ["Yes, we will review the budget numbers"]
    assert wrap("Good morning everyone, thanks for joining the call today".split(), 34, 2) == \
        ["Good morning everyone,", "thanks for joining the call today"]


def test_bad_rules_are_one_sentence(capsys, speech):
    with pytest.raises(RequestError, match="10 to 200 characters"):
        SubtitleRules(max_chars=5)
    with pytest.raises(RequestError, match="shortest time"):
        SubtitleRules(min_duration=8, max_duration=7)
    assert cli_main(["transcribe", str(speech["fox"]), "--max-lines", "0"]) == 2
    message = capsys.readouterr().err.strip()
    assert message == "cadence: A subtitle cue must have 1 to 5 lines (got 0)."
