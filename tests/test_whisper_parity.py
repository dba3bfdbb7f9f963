"""The reference Whisper decoder gives faster-whisper's token ids on the same weights."""

import pytest
from faster_whisper import WhisperModel

from engine.audio import load_audio
from engine.transcribe import transcribe_file
from engine.whisper_reference import WhisperReference

FW_OPTIONS = dict(beam_size=1, temperature=0, without_timestamps=True, condition_on_previous_text=False)


def _faster_whisper_tokens(model, path, language=None):
    segments, info = model.transcribe(load_audio(path), language=language, **FW_OPTIONS)
    return [t for s in segments for t in s.tokens], info.language


def _words(text):
    return [w.strip(".,!?").lower() for w in text.split()]


@pytest.mark.parametrize("model_name", ["whisper-tiny.en", "whisper-base"])
def test_token_parity_with_faster_whisper(model_name, request, speech, ct2_folder):
    loaded = request.getfixturevalue("tiny" if model_name == "whisper-tiny.en" else "base")
    ours = WhisperReference(loaded)
    theirs = WhisperModel(str(ct2_folder(model_name)), device="cpu", compute_type="float32")
    for name in ("fox", "report", "budget", "long"):
        transcript = transcribe_file(ours, speech[name])
        expected, language = _faster_whisper_tokens(theirs, speech[name])
        got = [t for s in transcript.segments for t in s.tokens]
        assert got == expected, f"{model_name} differs from faster-whisper on {name}"
        assert transcript.language == language == "en"
    long = transcribe_file(ours, speech["long"])
    assert len(long.segments) == 2 and long.segments[1].start == 30.0
    assert long.segments[-1].end <= long.duration
    assert "finance" in _words(long.text)


def test_multilingual_detects_language_and_matches(base, speech, ct2_folder):
    ours = WhisperReference(base)
    theirs = WhisperModel(str(ct2_folder("whisper-base")), device="cpu", compute_type="float32")
    transcript = transcribe_file(ours, speech["german"])
    expected, language = _faster_whisper_tokens(theirs, speech["german"])
    assert transcript.language == language == "de"
    assert [t for s in transcript.segments for t in s.tokens] == expected
    forced = transcribe_file(ours, speech["german"], language="de")
    assert forced.text == transcript.text


def test_english_only_model_refuses_other_languages(tiny, speech):
    from engine.errors import RequestError

    with pytest.raises(RequestError, match="English-only"):
        transcribe_file(WhisperReference(tiny), speech["fox"], language="de")
