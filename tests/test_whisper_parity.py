"""The reference Whisper decoder gives faster-whisper's token ids on the same weights."""

import pytest
from parity import clip_timestamps

from engine.audio import load_audio
from engine.whisper.pipeline import plan_transcription, transcribe_file
from engine.whisper.reference import WhisperReference
from engine.whisper.timestamps import TimestampRules

FW_OPTIONS = dict(beam_size=1, temperature=0, without_timestamps=True, condition_on_previous_text=False)


def _faster_whisper_tokens(model, path, language=None, same_windows=False):
    """faster-whisper's sequential run: its own fixed 30-s windows, or Cadence's voice-activity windows."""
    extra = {"clip_timestamps": clip_timestamps(path)} if same_windows else {}
    segments, info = model.transcribe(load_audio(path), language=language, **FW_OPTIONS, **extra)
    return [t for s in segments for t in s.tokens], info.language


def _words(text):
    return [w.strip(".,!?").lower() for w in text.split()]


# The parity tests below: tiny.en reads every sentence; base (about three times the work a window) the
# one-window and two-window cases, which the other two sentences only repeat (they cost it ~25 s in the
# token test and ~13 s in the timestamp test, of the suite's 2 cores).
PARITY_CLIPS = {"whisper-tiny.en": ("fox", "report", "budget", "long"), "whisper-base": ("fox", "long")}


@pytest.mark.parametrize("model_name", ["whisper-tiny.en", "whisper-base"])
def test_token_parity_with_faster_whisper(model_name, request, speech, faster_whisper):
    loaded = request.getfixturevalue("tiny" if model_name == "whisper-tiny.en" else "base")
    ours = WhisperReference(loaded)
    theirs = faster_whisper(model_name)
    runs = {}
    for name in PARITY_CLIPS[model_name]:
        # Fixed 30-s windows: faster-whisper's sequential run as it comes.
        transcript = runs[name, "fixed"] = transcribe_file(ours, speech[name], windowing="fixed")
        expected, language = _faster_whisper_tokens(theirs, speech[name])
        got = [t for s in transcript.segments for t in s.tokens]
        assert got == expected, f"{model_name} differs from faster-whisper on {name} (fixed windows)"
        assert transcript.language == language == "en"
        # Voice-activity windows (the default): faster-whisper given the same windows as its clips.
        transcript = runs[name, "vad"] = transcribe_file(ours, speech[name])
        expected, _ = _faster_whisper_tokens(theirs, speech[name], same_windows=True)
        got = [t for s in transcript.segments for t in s.tokens]
        assert got == expected, f"{model_name} differs from faster-whisper on {name} (voice-activity windows)"
    long = runs["long", "fixed"]
    assert len(long.segments) == 2 and long.segments[1].start == 30.0
    assert long.segments[-1].end <= long.duration
    assert "finance" in _words(long.text)
    by_vad = runs["long", "vad"]
    first, second = by_vad.segments  # two windows, cut in a pause the voice activity found
    assert first.end <= second.start and all(s.end - s.start <= 30.0 for s in by_vad.segments)
    assert 20.0 < second.start < long.duration - 1.0
    assert "finance" in _words(by_vad.text)


GLOSSARY = "Glossary: Kwik Braun Phocks, Cadence."


def test_initial_prompt_gives_faster_whisper_tokens(tiny, speech, faster_whisper):
    """An initial prompt is read as faster-whisper reads it (after <|startofprev|>) on a one-window clip, and it
    steers the words: the glossary's spelling comes through."""
    ours, theirs = WhisperReference(tiny), faster_whisper("whisper-tiny.en")
    for name in ("fox", "report"):
        transcript = transcribe_file(ours, speech[name], windowing="fixed", initial_prompt=GLOSSARY)
        segments, _ = theirs.transcribe(load_audio(speech[name]), initial_prompt=GLOSSARY, **FW_OPTIONS)
        assert [t for s in transcript.segments for t in s.tokens] == [t for s in segments for t in s.tokens], name
    steered = transcribe_file(ours, speech["fox"], windowing="fixed", initial_prompt=GLOSSARY)
    plain = transcribe_file(ours, speech["fox"], windowing="fixed")
    assert "Phocks" in steered.text and "Phocks" not in plain.text


@pytest.mark.parametrize("model_name", ["whisper-tiny.en", "whisper-base"])
def test_timestamp_tokens_match_ctranslate2_on_the_same_windows(model_name, request, speech, faster_whisper):
    """With timestamps, each window's tokens (times included) are the ones faster-whisper's decoder
    (CTranslate2's generate, with its time-token rules) writes for the same features and prompt."""
    import ctranslate2

    loaded = request.getfixturevalue("tiny" if model_name == "whisper-tiny.en" else "base")
    ours = WhisperReference(loaded)
    rules = TimestampRules.of(ours.tok)
    theirs = faster_whisper(model_name).model
    times = 0
    for name in PARITY_CLIPS[model_name]:
        plan = plan_transcription(ours, load_audio(speech[name]), timestamps=True)
        assert plan.prompt[-1] != ours.tok.no_timestamps
        for _, _, window in plan.spans:
            got = ours.decode(ours.encode(window), plan.prompt).tokens
            [result] = theirs.generate(ctranslate2.StorageView.from_array(window[None]), [plan.prompt], beam_size=1,
                                       max_length=448, suppress_blank=True, suppress_tokens=ours.suppress.tolist(),
                                       max_initial_timestamp_index=50)
            expected = [t for t in result.sequences_ids[0] if t != ours.tok.eot]
            assert got == expected, f"{model_name} differs from CTranslate2 on {name} with timestamps"
            assert got[0] >= rules.begin  # a window starts with its first time
            times += sum(t >= rules.begin for t in got)
    assert times >= 12  # phrases were timed, not one stretch per window


def test_multilingual_detects_language_and_matches(base, speech, faster_whisper):
    ours = WhisperReference(base)
    theirs = faster_whisper("whisper-base")
    transcript = transcribe_file(ours, speech["german"])
    expected, language = _faster_whisper_tokens(theirs, speech["german"], same_windows=True)
    assert transcript.language == language == "de"
    assert [t for s in transcript.segments for t in s.tokens] == expected
    forced = transcribe_file(ours, speech["german"], language="de")
    assert forced.text == transcript.text


def test_english_only_model_refuses_other_languages(tiny, speech):
    from engine.errors import RequestError

    with pytest.raises(RequestError, match="English-only"):
        transcribe_file(WhisperReference(tiny), speech["fox"], language="de")
