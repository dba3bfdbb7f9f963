"""Word timestamps: the batched engine times words exactly as the reference decoder does, within
0.1 s (median) of faster-whisper's word_timestamps=True on the same windows, without changing a
token; a model without alignment heads says so in a sentence."""

import difflib
import shutil
from statistics import median

import pytest
from parity import clip_timestamps

from engine import TranscribeRequest
from engine.audio import load_audio
from engine.errors import CadenceError
from engine.whisper.alignment import alignment_heads, dtw_path
from engine.whisper.pipeline import transcribe_file
from engine.whisper.reference import WhisperReference

import numpy as np


def _tokens(transcript):
    return [t for s in transcript.segments for t in s.tokens]


def _words(transcript):
    return [(w.text, w.start, w.end) for s in transcript.segments for w in s.words]


def test_the_path_through_the_attention_is_the_cheapest_monotonic_one():
    cost = np.array([[0, 5, 5, 5], [5, 0, 0, 5], [5, 5, 5, 0]], dtype=float)
    rows, columns = dtw_path(cost)
    assert list(zip(rows, columns)) == [(0, 0), (1, 1), (1, 2), (2, 3)]
    rows, columns = dtw_path(np.zeros((3, 1)))  # more rows than columns: straight down
    assert list(rows) == [0, 1, 2] and list(columns) == [0, 0, 0]


def test_engine_words_equal_the_reference_and_faster_whisper(engine4, tiny, speech, faster_whisper):
    ref = WhisperReference(tiny)
    theirs = faster_whisper("whisper-tiny.en")
    handles = {name: (engine4.submit(TranscribeRequest(speech[name], timestamps=True, words=True)),
                      engine4.submit(TranscribeRequest(speech[name], timestamps=True)))
               for name in ("fox", "report", "budget", "long")}
    differences = []
    for name, (timed, plain) in handles.items():
        got, without = timed.result(600), plain.result(600)
        assert _tokens(got) == _tokens(without), f"timing words changed the tokens of {name}"
        want = transcribe_file(ref, speech[name], timestamps=True, words=True)
        assert _words(got) == _words(want), f"the engine's words differ from the reference's on {name}"
        assert all(s.words for s in got.segments) and all(w.start <= w.end for s in got.segments for w in s.words)
        assert " ".join(w.text.strip() for s in got.segments for w in s.words) == " ".join(s.text for s in got.segments)
        segments, _ = theirs.transcribe(load_audio(speech[name]), beam_size=1, temperature=0,
                                        condition_on_previous_text=False, word_timestamps=True,
                                        clip_timestamps=clip_timestamps(speech[name]))
        expected = [(w.word.strip(), w.start) for s in segments for w in s.words]
        ours = [(w.text.strip(), w.start) for s in got.segments for w in s.words]
        matcher = difflib.SequenceMatcher(a=[w for w, _ in ours], b=[w for w, _ in expected], autojunk=False)
        for block in matcher.get_matching_blocks():
            differences += [abs(ours[block.a + k][1] - expected[block.b + k][1]) for k in range(block.size)]
        assert got.to_json()["segments"][0]["words"][0].keys() == {"start", "end", "word", "probability"}
    assert len(differences) >= 60  # the words were matched, not skipped
    assert median(differences) <= 0.1


def test_a_model_without_alignment_heads_refuses_word_timestamps(engine4, tiny, speech, tmp_path):
    folder = tmp_path / "whisper-unknown"
    tiny.model.save_pretrained(folder)
    shutil.copy(tiny.report.cache_path + "/tokenizer.json", folder / "tokenizer.json")
    from engine.loading import load

    assert alignment_heads(load(str(folder))) is None
    with pytest.raises(CadenceError, match="no known alignment heads"):
        engine4.submit(TranscribeRequest(speech["fox"], model=str(folder), words=True)).result(600)
    plain = engine4.submit(TranscribeRequest(speech["fox"], model=str(folder))).result(600)
    assert "fox" in plain.text.lower()  # the same model transcribes without word timestamps
