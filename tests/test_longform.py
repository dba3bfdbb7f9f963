"""Long-form transcription on the batched engine: an hour of speech, a batch mixing short and long
files equal to faster-whisper's words (batched and unbatched), and WER against the known text."""

import subprocess

import pytest
from conftest import SPEECH, synthesize
from parity import clip_timestamps

from engine import Engine, TranscribeRequest
from engine.wer import wer as word_error_rate

ENGLISH = ["fox", "report", "budget", "weather"]
WER_LIMIT = {"whisper-tiny.en": 0.35, "whisper-base": 0.25}  # robotic espeak speech (see MODELS.md)
# Over an hour, tiny.en drops and garbles more in full 30-s windows than in single sentences
# (measured: 0.15 on one 23-s unit, 0.26 on ten, 0.41 on the hour); the limit catches lost windows.
HOUR_WER_LIMIT = 0.5


def fw_tokens(model, clip) -> list[int]:
    """faster-whisper's sequential run on the voice-activity windows Cadence decodes by default."""
    segments, _ = model.transcribe(str(clip), language="en", beam_size=1, temperature=0, without_timestamps=True,
                                   condition_on_previous_text=False, clip_timestamps=clip_timestamps(clip))
    return [t for s in segments for t in s.tokens]


@pytest.fixture(scope="module")
def untimed(engine4, engine_off, speech):
    """Per model, every clip of the two tests below (the long one and the four sentences), in English without
    timestamps: all submitted at once to 4 slots (a batch mixing the long clip with short ones), and each on
    the single-stream path. Decoded once for both tests, which used to decode three of the clips twice each."""
    results = {}

    def get(model):
        if model not in results:
            names = ["long", *ENGLISH]
            out = []
            for engine in (engine4, engine_off):
                handles = {n: engine.submit(TranscribeRequest(speech[n], model=model, language="en")) for n in names}
                out.append({n: h.result(600) for n, h in handles.items()})
            results[model] = tuple(out)
        return results[model]

    return get


@pytest.mark.parametrize("model", ["whisper-tiny.en", "whisper-base"])
def test_mixed_batch_equals_faster_whisper_batched_and_unbatched(model, untimed, speech, faster_whisper):
    names = ["long", "fox", "weather", "report"]
    want = {n: fw_tokens(faster_whisper(model), speech[n]) for n in names}
    for results in untimed(model):  # 4 slots, then the single-stream path
        for n in names:
            got = [t for s in results[n].segments for t in s.tokens]
            assert got == want[n], f"{model} {n} differs from faster-whisper"


@pytest.mark.parametrize("model", ["whisper-tiny.en", "whisper-base"])
def test_word_error_rate_is_within_the_limit_and_the_same_batched(model, untimed):
    batched, serial = untimed(model)
    for name in ENGLISH:
        text, alone = batched[name].text, serial[name].text
        wer = word_error_rate(SPEECH[name][2], text)
        assert wer <= WER_LIMIT[model], f"{model} on {name}: WER {wer:.2f} ({text!r})"
        assert alone == text


def test_timed_phrases_batched_and_drafted_equal_the_reference(engine4, engine_off, tiny, speech, monkeypatch):
    """With timestamps, the engine (4 slots, drafting, and one slot) writes the reference decoder's
    tokens, times included, and the segments are the phrases: a few seconds each, in order."""
    import engine.whisper.pipeline as transcribe
    from engine.whisper.features import pad_window
    from engine.whisper.reference import WhisperReference

    reference = WhisperReference(tiny)

    def same_as_reference(name):
        want = transcribe.transcribe_file(reference, speech[name], language="en", timestamps=True)
        for engine in (engine4, engine_off):
            got = engine.submit(TranscribeRequest(speech[name], model="whisper-tiny.en", language="en",
                                                  timestamps=True)).result(600)
            assert [(s.start, s.end, s.tokens) for s in got.segments] == \
                   [(s.start, s.end, s.tokens) for s in want.segments], f"{name} differs from the reference"
        return want

    wanted = {}
    for name in ("long", "fox", "weather"):
        want = wanted[name] = same_as_reference(name)
        times = [(s.start, s.end) for s in want.segments]
        assert all(0 <= a < b <= want.duration + 1e-6 for a, b in times)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(times, times[1:]))
        parts = ("fox", "report", "budget", "weather", "fox", "report") if name == "long" else (name,)
        known = " ".join(SPEECH[p][2] for p in parts)
        assert word_error_rate(known, want.text) <= WER_LIMIT["whisper-tiny.en"], want.text
    long = wanted["long"]  # (the reference's run above: the same call, not made twice)
    assert len(long.segments) >= 6 and max(b - a for a, b in [(s.start, s.end) for s in long.segments]) < 15.0

    # Where the model stops a window early, the rest is decoded as a follow-up part (whether it does on
    # this speech is a near call, so here every window gets one, from 2 s in): the engine's parts, their
    # order and their joining are the reference's, token for token.
    def every_window_once(plan, rules, index, tokens, part, parts):
        _, size, window = plan.spans[index]
        return (100, pad_window(window[:, 200:size])) if parts == 1 else None

    monkeypatch.setattr(transcribe, "follow_up", every_window_once)
    forced = same_as_reference("long")
    assert len(forced.segments) > len(long.segments)  # the parts' phrases were joined on


def test_an_hour_of_speech(session_dir):
    """One hour of generated speech (a minute of varied sentences, sixty times), about 120 windows, in
    bfloat16 where the machine offers it, else int8 (this checks length and words, not float32 parity; in
    `make test` on a 2-core AMD EPYC without bfloat16 it took 130 s in int8, against 163 s in float32 in an
    earlier run of the same day: not side by side)."""
    from engine.kernels import precisions_on

    precision = "bfloat16" if "bfloat16" in precisions_on("cpu") else "int8"
    # 16 slots, drafting as shipped: on a quiet 2-core AMD EPYC the hour took 96 s in float32, against 114 s at 8 undrafted.
    engine = Engine(backend="cpu", batch=16, precision=precision)
    try:
        _transcribe_an_hour(engine, session_dir)
    finally:
        engine.shutdown()


def _transcribe_an_hour(engine4, session_dir):
    folder = session_dir / "hour"
    folder.mkdir()
    parts = [synthesize(SPEECH[n][2], folder / f"{n}.wav", SPEECH[n][0], SPEECH[n][1]) for n in ENGLISH]
    minute = folder / "minute.wav"
    subprocess.run(["sox", *map(str, parts), str(minute), "pad", "0", "0"], check=True)
    seconds = float(subprocess.run(["soxi", "-D", str(minute)], capture_output=True, text=True, check=True).stdout)
    hour = folder / "hour.wav"
    repeats = int(3600 // seconds) + 1
    subprocess.run(["sox", str(minute), str(hour), "repeat", str(repeats - 1)], check=True)
    transcript = engine4.submit(TranscribeRequest(hour, model="whisper-tiny.en", language="en")).result(1800)
    assert transcript.duration >= 3600
    times = [(s.start, s.end) for s in transcript.segments]
    assert len(times) >= 115  # a segment per window (up to 30 s each), nearly all with speech
    assert all(0 <= a < b <= transcript.duration + 1e-6 for a, b in times)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(times, times[1:]))
    known = " ".join([" ".join(SPEECH[n][2] for n in ENGLISH)] * repeats)
    assert word_error_rate(known, transcript.text) <= HOUR_WER_LIMIT


def test_two_hours_mostly_silence_decodes_only_the_windows_with_sound(engine4, speech, session_dir):
    two_hours = session_dir / "two-hours.wav"
    subprocess.run(["sox", str(speech["fox"]), str(two_hours), "pad", "0", "7200"], check=True)
    subprocess.run(["sox", str(two_hours), str(speech["report"]), str(session_dir / "two-hours-end.wav")], check=True)
    def steps():
        lane = engine4.status()["lanes"].get("whisper-tiny.en")
        return lane["counters"]["steps"] if lane else 0

    steps_before = steps()
    transcript = engine4.submit(TranscribeRequest(session_dir / "two-hours-end.wav", model="whisper-tiny.en")).result(900)
    assert transcript.duration > 7200
    fox = float(subprocess.run(["soxi", "-D", str(speech["fox"])], capture_output=True, text=True, check=True).stdout)
    starts = [s.start for s in transcript.segments]  # the two voices only: no window in two hours of silence
    assert len(starts) == 2 and starts[0] < 1.0 and abs(starts[1] - (fox + 7200)) < 1.0, starts
    assert "dog" in transcript.segments[0].text.lower() and "report" in transcript.segments[1].text.lower()
    assert steps() - steps_before < 200  # 2 windows decoded, not 241


def test_language_is_detected_and_translate_gives_english(engine4, speech):
    german = engine4.submit(TranscribeRequest(speech["german"], model="whisper-base")).result(600)
    assert german.language == "de" and "morgen" in german.text.lower()
    english = engine4.submit(TranscribeRequest(speech["german"], model="whisper-base", task="translate")).result(600)
    assert english.language == "de"
    assert any(w in english.text.lower() for w in ("morning", "week", "plan")), english.text
