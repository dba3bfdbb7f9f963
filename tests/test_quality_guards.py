"""Quality guards: repetition loops are cut, silence gives no text, timestamps stay in order."""

import numpy as np

from engine import TranscribeRequest
from engine.whisper.pipeline import cut_repetition, repetition_start


def test_a_looping_tail_is_cut_after_its_first_unit():
    line = [10, 11, 12, 13, 14]
    tokens = [1, 2, 3] + line * 6
    assert repetition_start(tokens) == 3 + len(line)
    assert cut_repetition(tokens) == [1, 2, 3] + line
    assert cut_repetition([7] * 20) == [7]


def test_ordinary_repetition_is_kept():
    no = [5, 6]  # "no," four times is speech, not a loop
    assert repetition_start([1] + no * 4) is None
    assert cut_repetition([1, 2, 3, 4, 5, 6, 7, 8]) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert repetition_start([1, 2, 3] * 3) is None  # 9 tokens: below the minimum span


def test_silence_gives_no_text_and_no_hallucinated_lines(engine4):
    silence = np.zeros(16000 * 65, dtype=np.float32)  # three windows of silence
    transcript = engine4.submit(TranscribeRequest(silence, model="whisper-tiny.en")).result(300)
    assert transcript.text == "" and transcript.segments == []
    # A multilingual model reports no language for a file without speech (none is guessed from silence).
    multilingual = engine4.submit(TranscribeRequest(silence, model="whisper-base")).result(300)
    assert multilingual.segments == [] and multilingual.language is None


def test_segments_are_ordered_and_inside_the_file(engine4, speech):
    transcript = engine4.submit(TranscribeRequest(speech["long"], model="whisper-tiny.en")).result(300)
    times = [(s.start, s.end) for s in transcript.segments]
    assert times and all(0 <= a < b <= transcript.duration + 1e-6 for a, b in times)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(times, times[1:]))
