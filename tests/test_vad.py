"""Voice activity: speech found where it is, windows of at most 30 s cut in pauses, silence never
decoded, and the words that fixed 30-s windows lose on dense speech kept."""

import numpy as np
import pytest

from conftest import synthesize
from engine.audio import load_audio
from engine.whisper.pipeline import plan_transcription, plan_windows, transcribe_file
from engine.whisper.vad import CHUNK, SAMPLE_RATE, SileroVad, VadOptions, speech_regions, vad_windows
from engine.wer import wer
from engine.whisper.features import log_mel
from engine.whisper.reference import WhisperReference

SENTENCES = [
    "The ferry leaves the harbour at seven and reaches the island just before noon.",
    "Our cousins built a wooden cabin beside the lake with their own hands.",
    "The bakery ran out of bread early because a school ordered two hundred rolls.",
    "Please water the tomatoes twice a week and pick the ripe ones on Saturday.",
    "The choir practised in the old church because the hall was being painted.",
    "A flock of geese flew south over the valley as the first frost arrived.",
    "The museum guide told us how the castle walls were built without any machines.",
    "My brother repaired the bicycle chain and oiled the brakes before the race.",
    "The village market opens on Thursdays and sells cheese, apples and warm soup.",
    "Heavy snow closed the mountain pass, so the bus took the longer road instead.",
    "The young pilot checked the engines twice before she taxied onto the runway.",
    "Our teacher read a story about a lighthouse keeper and his clever parrot.",
    "The factory switched to solar panels and cut its electricity bill in half.",
    "After dinner we walked along the river and watched the sun go down.",
    "The library lends telescopes to families who want to look at the stars.",
    "Farmers in the north planted barley early because the spring was so warm.",
]


@pytest.fixture(scope="session")
def vad():
    return SileroVad()


@pytest.fixture(scope="session")
def dense(session_dir):
    """About 90 s of speech with only sentence pauses: what fixed windows cut through (measured with
    whisper-tiny.en: fixed windows 44% WER, the last 30 s decoded to nothing; voice activity 10%)."""
    path = session_dir / "dense.wav"
    synthesize(" ".join(SENTENCES), path, "en-us+f3", 130)
    return path, " ".join(SENTENCES)


def test_speech_is_found_where_it_is_and_not_in_silence_or_noise(vad, speech):
    voice = load_audio(speech["fox"])
    rng = np.random.default_rng(0)
    gap = np.zeros(3 * SAMPLE_RATE, np.float32)
    hiss = (0.01 * rng.standard_normal(3 * SAMPLE_RATE)).astype(np.float32)
    audio = np.concatenate([gap, voice, hiss, voice, gap])
    probs = vad(audio)
    assert probs.shape == (-(-audio.size // CHUNK),)
    regions = speech_regions(probs, audio.size)
    assert len(regions) >= 2
    first_voice = (3 * SAMPLE_RATE, 3 * SAMPLE_RATE + voice.size)
    second_voice = (6 * SAMPLE_RATE + voice.size, 6 * SAMPLE_RATE + 2 * voice.size)
    pad = VadOptions().pad_ms * SAMPLE_RATE // 1000 + CHUNK
    for s, e in regions:  # every region lies in one of the two voices (with its padding)
        assert any(lo - pad <= s and e <= hi + pad for lo, hi in (first_voice, second_voice)), (s, e)
    assert regions[0][0] <= first_voice[0] + SAMPLE_RATE // 2  # speech onsets are found within half a second
    assert any(abs(s - second_voice[0]) <= SAMPLE_RATE // 2 for s, _ in regions)
    assert vad(np.zeros(5 * SAMPLE_RATE, np.float32)).max() < 0.5
    assert speech_regions(vad(hiss), hiss.size) == []


def _probs(seconds, *speech):
    """Made-up probabilities: 0.95 in the given (start, end) seconds, 0 elsewhere."""
    p = np.zeros(-(-int(seconds * SAMPLE_RATE) // CHUNK), np.float32)
    for a, b in speech:
        p[int(a * SAMPLE_RATE) // CHUNK : int(b * SAMPLE_RATE) // CHUNK] = 0.95
    return p, int(seconds * SAMPLE_RATE)


def test_region_rules_on_made_up_probabilities():
    ms = CHUNK * 1000 / SAMPLE_RATE  # 32 ms per chunk
    p, n = _probs(10, (1, 3), (3 + 2 * ms / 1000, 5), (5 + 4 * ms / 1000, 7), (8, 8.1))
    regions = speech_regions(p, n)
    # a 64-ms pause does not end speech, a 128-ms one does; 0.1 s of "speech" is dropped
    assert len(regions) == 2, regions
    (s1, e1), (s2, e2) = regions
    assert s1 == SAMPLE_RATE // CHUNK * CHUNK - VadOptions().pad_ms * SAMPLE_RATE // 1000  # padded before ...
    gap = int((5 + 4 * ms / 1000) * SAMPLE_RATE) // CHUNK * CHUNK - int(5 * SAMPLE_RATE) // CHUNK * CHUNK
    assert e1 - 5 * SAMPLE_RATE <= gap // 2 + CHUNK and s2 >= e1  # ... and by at most half the pause between
    assert abs(e2 - (7 * SAMPLE_RATE + VadOptions().pad_ms * SAMPLE_RATE // 1000)) <= CHUNK


def test_overlong_speech_is_cut_late_and_leaves_no_crumb():
    p, n = _probs(40, (3, 32.8))  # 29.8 s of speech: over 30 s only with its padding
    assert vad_windows(p, n) == [(289, 3000)]  # padded less, not cut
    p[int(32.8 * SAMPLE_RATE) // CHUNK - 3 : int(32.8 * SAMPLE_RATE) // CHUNK] = 0.45  # a fading tail ...
    p[int(32.8 * SAMPLE_RATE) // CHUNK : int(33.5 * SAMPLE_RATE) // CHUNK] = 0.95  # ... then more speech
    spans = vad_windows(p, n)
    assert len(spans) == 2 and all(size >= 100 for _, size in spans)  # the rest is at least a second
    flat, n = np.full(-(-7200 * SAMPLE_RATE // CHUNK), 0.99, np.float32), 7200 * SAMPLE_RATE
    spans = vad_windows(flat, n)  # two hours without a pause: cut as late as allowed
    assert max(size for _, size in spans) <= 3000 and min(size for _, size in spans[:-1]) >= 2900
    assert sum(size for _, size in spans) == 720000 and len(spans) <= 245


def test_long_audio_is_read_in_blocks_with_the_same_probabilities(vad, dense, monkeypatch):
    import engine.whisper.vad

    audio = load_audio(dense[0])
    whole = vad(audio)
    monkeypatch.setattr(engine.whisper.vad, "BLOCK", 100)  # ~3 s per call: dozens of calls, the state carried over
    assert np.array_equal(vad(audio), whole)


def test_windows_are_at_most_30_s_and_cut_where_the_speaker_pauses(vad, dense):
    path, _ = dense
    audio = load_audio(path)
    probs = vad(audio)
    spans = vad_windows(probs, audio.size)
    assert len(spans) >= 3
    frames = 100  # feature frames per second
    for (seek, size), (next_seek, _) in zip(spans, spans[1:]):
        assert 0 < size <= 30 * frames and seek + size <= next_seek  # in order, not overlapping
        cut = (seek + size) * 160 // CHUNK
        assert probs[max(0, cut - 2) : cut + 2].min() < 0.5  # the cut is in a pause, not inside a word
    seek, size = spans[-1]
    assert 0 < size <= 30 * frames and seek + size <= -(-audio.size // 160)
    # Fixed windows cut at 30 s whatever is said there.
    fixed = plan_windows(log_mel(audio), audio, "fixed")
    assert [s for s, _, _ in fixed][:2] == [0, 3000]


def test_silence_gets_no_window_at_all(tiny):
    plan = plan_transcription(WhisperReference(tiny), np.zeros(10 * SAMPLE_RATE, np.float32), "en")
    assert plan.spans == []


def test_voice_activity_windows_keep_the_words_fixed_windows_lose(tiny, dense):
    path, text = dense
    ours = WhisperReference(tiny)
    by_vad = transcribe_file(ours, path)
    fixed = transcribe_file(ours, path, windowing="fixed")
    assert wer(text, by_vad.text) < 0.2, by_vad.text
    assert wer(text, by_vad.text) < wer(text, fixed.text)
    starts = [s.start for s in by_vad.segments]
    assert starts == sorted(starts) and all(s.end - s.start <= 30.0 for s in by_vad.segments)
    assert by_vad.segments[-1].end <= by_vad.duration


def test_unknown_windowing_is_refused(tiny, speech):
    from engine.errors import RequestError

    with pytest.raises(RequestError, match="Unknown windowing 'sliding'"):
        transcribe_file(WhisperReference(tiny), speech["fox"], windowing="sliding")


def test_cli_transcribes_with_either_windowing(speech, tmp_path, capsys):
    # The command line's own entry point, in this process (as tests/test_speakers.py and test_subtitles.py
    # run it): the flag's path is the same, without a new process's imports (about 6 CPU s each).
    from app.cli import main as cli_main

    for windowing in ("vad", "fixed"):
        out = tmp_path / windowing
        rc = cli_main(["transcribe", str(speech["fox"]), "--model", "whisper-tiny.en", "--windows", windowing,
                       "--out", str(out), "--format", "txt"])
        err = capsys.readouterr().err
        assert rc == 0, err
        assert "Traceback" not in err
        assert "fox" in (out / "fox.txt").read_text().lower()
