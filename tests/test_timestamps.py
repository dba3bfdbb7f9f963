"""Whisper's time tokens without a model: the rules that keep them well formed, the phrases read back
from them, and the rest of a window the model left decoded as a follow-up part."""

import numpy as np
import torch

from engine.whisper.pipeline import FOLLOW_UP_MIN_S, MAX_PARTS, TranscriptionPlan, follow_up
from engine.whisper.features import pad_window
from engine.whisper.timestamps import TimestampRules

EOT, NO_TS, BEGIN, END = 50, 51, 52, 52 + 1500  # a made-up vocabulary: text 0..49, times 52..1552
RULES = TimestampRules(eot=EOT, no_timestamps=NO_TS, begin=BEGIN, end=END, max_initial=BEGIN + 50)


def t(seconds: float) -> int:
    return BEGIN + round(seconds / 0.02)


def allowed(generated, logits=None) -> set[int]:
    row = torch.zeros(END + 1) if logits is None else logits.clone()
    RULES.apply(row, generated)
    return {i for i in range(END + 1) if row[i] != -float("inf")}


def test_time_tokens_come_first_in_pairs_and_never_go_back():
    first = allowed([])
    assert first == set(range(BEGIN, BEGIN + 51))  # a time of at most 1 s, nothing else
    after_pair = allowed([t(0), 7, t(1.0), t(1.0)])
    assert after_pair == set(range(EOT + 1))  # after a pair: text or the end, no time
    likely_end = torch.zeros(END + 1)
    likely_end[EOT] = 10.0
    after_close = allowed([t(0), 7, t(2.0)], likely_end)
    assert after_close == {EOT} | set(range(t(2.0), END + 1))  # a closing time: another time or the end
    after_text = allowed([t(0.5), 7, 8])
    assert min(i for i in after_text if i >= BEGIN) == t(0.5)  # times never before the last one
    assert NO_TS not in allowed([t(0), 7])


def test_a_time_is_forced_where_the_times_together_beat_every_text_token():
    logits = torch.full((END + 1,), -10.0)
    logits[3] = 2.0  # the likeliest single token is text ...
    logits[BEGIN:END + 1] = 0.0  # ... but 1500 times at 0.0 together outweigh it
    assert allowed([t(0), 7], logits) == set(range(BEGIN, END + 1))
    logits[BEGIN:END + 1] = -10.0
    assert 3 in allowed([t(0), 7], logits)


def test_phrases_are_read_from_the_times_on_the_files_clock():
    tokens = [t(0), 1, 2, t(2.5), t(2.5), 3, t(4.0), t(4.2), 4, 5]  # the last phrase is still open
    assert RULES.segments(tokens, 10.0, 18.0) == [(10.0, 12.5, [1, 2]), (12.5, 14.0, [3]), (14.2, 18.0, [4, 5])]
    clamped = RULES.segments([t(0), 1, t(29.0)], 10.0, 20.0)  # a time past the window's end is kept inside
    assert clamped == [(10.0, 20.0, [1])]


def test_the_rest_of_a_window_left_by_the_model_is_a_follow_up_part():
    size = 2000  # 20 s of content in a 30-s window
    window = pad_window(np.arange(80 * size, dtype=np.float32).reshape(80, size))
    plan = TranscriptionPlan("clip", "en", [], 20.0, [(0, size, window)], 0.0, timestamps=True)
    first = [t(0), 1, t(6.0), t(6.0)]  # ended on a pair at 6 s: the model left the rest
    steps, rest = follow_up(plan, RULES, 0, first, first, 1)
    assert steps == 300 and np.array_equal(rest, pad_window(window[:, 600:size]))
    second = [t(0.4), 2, t(3.0), t(3.0)]  # decoded from 6 s: its times are 6 s behind the window's
    joined = RULES.join(first, second, steps)
    assert joined == [t(0), 1, t(6.0), t(6.0), t(6.4), 2, t(9.0), t(9.0)]  # every decoded token kept
    assert follow_up(plan, RULES, 0, joined, second, 2)[0] == 450  # the next part starts at 9 s
    assert RULES.segments(joined, 0.0, 20.0) == [(0.0, 6.0, [1]), (6.4, 9.0, [2])]
    # Nothing to follow: a single closing time, too little left, too many parts, or no timestamps.
    assert follow_up(plan, RULES, 0, [t(0), 1, t(6.0)], [t(0), 1, t(6.0)], 1) is None
    near_end = [t(0), 1, t(20.0 - FOLLOW_UP_MIN_S / 2), t(20.0 - FOLLOW_UP_MIN_S / 2)]
    assert follow_up(plan, RULES, 0, near_end, near_end, 1) is None
    assert follow_up(plan, RULES, 0, first, first, MAX_PARTS) is None
    assert follow_up(plan, None, 0, first, first, 1) is None
