"""Live captions: a recording fed block by block through the recorder's own path is captioned window
by window while it is recorded, ahead of queued files, and its final transcript after Stop is the one
transcribing the saved file gives (windows decoded live reused where identical); nothing is lost."""

import shutil
import threading
import time

import numpy as np
import soundfile as sf
from app_support import app_home, open_window, wait_jobs_settled  # noqa: F401
from conftest import SPEECH, synthesize

from app.recorder import Recorder
from engine import LiveTranscribeRequest, TranscribeRequest
from engine.whisper.live import LiveAudio

BLOCK = 480  # frames per callback at 48 kHz


def _speech_48k(folder, names=("fox", "report", "budget")):
    parts = []
    for name in names:
        voice, rate, text = SPEECH[name]
        samples, sr = sf.read(synthesize(text, folder / f"{name}-48k.wav", voice, rate, sample_rate=48000),
                              dtype="float32")
        parts += [samples, np.zeros(sr // 2, np.float32)]
    return np.concatenate(parts)


def _feed(recorder: Recorder, samples: np.ndarray) -> None:
    """The samples block by block from another thread, as PortAudio's callback delivers them."""
    def run():
        for start in range(0, len(samples), BLOCK):
            block = samples[start : start + BLOCK].reshape(-1, 1)
            recorder.callback(block, len(block), None, None)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def _segments(transcript):
    return [(round(s.start, 3), round(s.end, 3), s.text) for s in transcript.segments]


def test_live_audio_is_the_files_audio_frame_for_frame(tmp_path):
    """The live side's voice activity and log-mel frames equal the saved file's, bit for bit."""
    from engine.audio import load_audio
    from engine.whisper.features import log_mel, log_mel_frames, normalize
    from engine.whisper.vad import speech_probabilities

    speech = _speech_48k(tmp_path, ("fox", "report"))
    recorder = Recorder(tmp_path)
    live = LiveAudio()
    live.n_mels = 80
    live.ready.set()
    recorder.on_block = live.add
    recorder.start(rate=48000, open_stream=False)
    _feed(recorder, speech)
    path = recorder.stop()
    live.collector._flush()
    live.update(final=True)
    samples = load_audio(path)
    assert np.array_equal(live.samples, samples)
    assert np.array_equal(live._voice(True), speech_probabilities(samples))
    inner = live.frames - 2  # the file's last frames also see its end padding
    padded = np.pad(np.pad(samples, (0, 160)), (200, 200), mode="reflect")
    assert np.array_equal(live.spectrum[:, :inner], log_mel_frames(padded, 0, inner, 80))
    assert np.array_equal(normalize(live.spectrum[:, :inner], live.top), log_mel(samples)[:, :inner])


def test_recording_is_captioned_live_and_its_transcript_is_the_files(engine4, tmp_path):
    speech = _speech_48k(tmp_path)
    recorder = Recorder(tmp_path)
    live = engine4.submit(LiveTranscribeRequest(timestamps=True))
    recorder.on_block = live.feed
    recorder.start(rate=48000, open_stream=False)
    _feed(recorder, speech)
    captions = []
    for event in live:  # captions come while the recording is still running
        if event.kind == "progress":
            captions.append(event.text)
            break
    assert recorder.state == "recording" and captions and captions[0]
    path = recorder.stop()
    live.stop()
    for event in live:
        if event.kind == "progress":
            captions.append(event.text)
    assert live.final.kind == "finished"
    final = engine4.submit(TranscribeRequest(path, timestamps=True, known_windows=live.known)).result(600)
    plain = engine4.submit(TranscribeRequest(path, timestamps=True)).result(600)
    assert _segments(final) == _segments(plain) and "quarterly report" in final.text.lower()
    assert final.stats.get("reused_windows", 0) >= 1  # the live work was used, not redone
    assert "friday" in " ".join(captions).lower()


def test_captions_are_served_before_fifty_queued_files(engine4, speech, tmp_path):
    copies = []
    for i in range(50):
        copies.append(tmp_path / f"queued-{i}.wav")
        shutil.copy(speech["report"], copies[-1])
    handles = [engine4.submit(TranscribeRequest(p)) for p in copies]
    live = engine4.submit(LiveTranscribeRequest(timestamps=True))
    samples = _speech_48k(tmp_path, ("fox",))
    for start in range(0, len(samples), BLOCK):
        live.feed(samples[start : start + BLOCK].reshape(-1, 1), 48000)
    live.stop()
    first = next(e for e in live if e.kind in ("progress", "failed"))
    unfinished = sum(not h.ended for h in handles)
    for h in handles:
        h.cancel()
    assert first.kind == "progress" and "fox" in first.text.lower()
    assert unfinished >= 25, f"the caption waited for {50 - unfinished} of 50 files"


def test_record_tab_shows_captions_and_queues_the_same_transcript(qtbot, app_home, tmp_path):  # noqa: F811
    """Captions while recording; what is said while paused is in neither the file nor the captions;
    after Stop the queued job's transcript is the saved file's."""
    first, paused, rest = (_speech_48k(tmp_path, names) for names in (("fox",), ("weather",), ("report", "budget")))
    window = open_window(qtbot, app_home())
    view = window.recording
    view.record(rate=48000, open_stream=False)
    assert view.live is not None
    _feed(view.recorder, first)
    qtbot.waitUntil(lambda: "fox" in view.caption_text.lower(), timeout=180000)
    assert view.recorder.state == "recording"  # shown while recording
    view.toggle_pause()
    _feed(view.recorder, paused)  # not recorded, so not captioned
    view.toggle_pause()
    _feed(view.recorder, rest)
    path = view.stop()
    assert sf.info(path).frames == len(first) + len(rest)
    qtbot.waitUntil(lambda: "friday" in view.caption_text.lower() and "hires" in view.caption_text.lower(),
                    timeout=180000)
    wait_jobs_settled(qtbot, window, timeout=300)
    [job] = window.bridge.jobs.list()
    assert job.state == "done" and job.path == str(path)
    assert "umbrella" not in view.caption_text.lower()
    qtbot.waitUntil(lambda: view.live is None, timeout=60000)  # the live run's last event was shown
    assert view.provisional_lines() == []  # every window read whole by now: no caption left in grey
    plain = window.bridge.engine.submit(TranscribeRequest(path, timestamps=True)).result(600)
    assert job.result["text"] == plain.text
    assert [(s["start"], s["end"], s["text"]) for s in job.result["segments"]] == \
        [(round(s.start, 3), round(s.end, 3), s.text) for s in plain.segments]


def test_closing_while_recording_live_keeps_and_transcribes_everything(qtbot, app_home, tmp_path):  # noqa: F811
    """Closing Cadence mid-recording (captions in flight) saves the whole recording and queues it; on the
    next start its job gives the saved file's transcript."""
    speech = _speech_48k(tmp_path, ("fox", "report"))
    window = open_window(qtbot, app_home())
    window.recording.record(rate=48000, open_stream=False)
    assert window.recording.live is not None
    _feed(window.recording.recorder, speech)
    window.close()  # the live transcription is still decoding its windows

    reopened = open_window(qtbot, app_home())
    wait_jobs_settled(qtbot, reopened, timeout=300)
    [job] = reopened.bridge.jobs.list()
    assert job.state == "done", job.error
    assert sf.info(job.path).frames == len(speech)
    plain = reopened.bridge.engine.submit(TranscribeRequest(job.path, timestamps=True)).result(600)
    assert job.result["text"] == plain.text and "friday" in plain.text.lower() and "fox" in plain.text.lower()


def test_a_slot_is_kept_free_for_a_recording_while_files_fill_the_others(engine4, speech, tmp_path):
    """While a recording is live, queued files leave one slot of the lane free (its next window starts at
    once rather than after a file's window ends); after it stops, the files take every slot again."""
    model = "whisper-tiny.en"
    live = engine4.submit(LiveTranscribeRequest(model=model))
    copies = []
    for i in range(16):
        copies.append(tmp_path / f"queued-{i}.wav")
        shutil.copy(speech["report"], copies[-1])
    handles = [engine4.submit(TranscribeRequest(p, model=model)) for p in copies]

    def busy_with_files() -> tuple[int, dict]:
        lane = engine4.status()["lanes"].get(model)
        while lane is None:  # until the lane is made (the model loads once, for the whole suite)
            time.sleep(0.05)
            lane = engine4.status()["lanes"].get(model)
        return sum(s is not None and s["request"] != live.id for s in lane["slots"]), lane

    try:
        full_with_others_waiting, polls = 0, []
        deadline = time.monotonic() + 180
        busy, lane = busy_with_files()
        while not lane["held_for_live"] and time.monotonic() < deadline:  # the engine thread takes the commands
            assert busy == 0, (busy, lane["waiting"])  # the recording came first: no file may start before its hold
            time.sleep(0.01)
            busy, lane = busy_with_files()
        while full_with_others_waiting < 20 and time.monotonic() < deadline:
            busy, lane = busy_with_files()
            polls.append((busy, lane["waiting"], lane["held_for_live"]))
            assert lane["held_for_live"] and busy < lane["width"], polls[-20:]  # never every slot
            full_with_others_waiting += busy == lane["width"] - 1 and lane["waiting"] > 0
            time.sleep(0.05)
        width = engine4.status()["lanes"][model]["width"]
        assert width > 1 and full_with_others_waiting == 20, polls[-20:]  # files at work, one slot left free
        live.stop()
        assert live.result(120) is not None
        seen_after = []
        while time.monotonic() < deadline and not all(h.ended for h in handles):
            busy, lane = busy_with_files()
            seen_after.append((busy, lane["held_for_live"]))
            if seen_after[-1] == (width, False):
                break
            time.sleep(0.02)
        assert seen_after[-1] == (width, False), seen_after[-20:]  # the files take every slot again
    finally:
        for h in handles:
            h.cancel()


def test_a_window_that_grows_keeps_its_captions_and_adds_the_new_speech(engine4, tmp_path):
    """Speech resumed within a window's 30 s grows it: its caption then comes from decoding the new speech
    alone, joined onto the earlier caption (provisional: the earlier lines kept as they were); after Stop
    the window is decoded whole, and the saved file's transcription reuses that and equals a plain one."""
    first, second = _speech_48k(tmp_path, ("fox",)), _speech_48k(tmp_path, ("report",))
    live = engine4.submit(LiveTranscribeRequest(timestamps=True))

    def feed(samples):
        for start in range(0, len(samples), BLOCK):
            live.feed(samples[start : start + BLOCK].reshape(-1, 1), 48000)

    feed(first)
    captions = [next(e for e in live if e.kind in ("progress", "failed"))]
    assert captions[0].kind == "progress" and not captions[0].provisional, captions[0]
    feed(second)
    for event in live:
        assert event.kind == "progress", event
        captions.append(event)
        if "quarterly report" in event.text.lower():
            break
    assert len(captions) >= 2 and "fox" in captions[0].text.lower()
    for before, grown in zip(captions, captions[1:]):  # each caption of the window keeps the lines before it
        assert grown.index == captions[0].index and grown.provisional
        kept = [(s.start, s.end, s.text) for s in before.segments]
        assert [(s.start, s.end, s.text) for s in grown.segments[: len(kept)]] == kept and len(grown.segments) > len(kept)
    live.stop()
    after_stop = [e for e in live if e.kind == "progress"]
    assert live.final.kind == "finished" and after_stop and not after_stop[-1].provisional
    assert after_stop[-1].index == captions[0].index  # the whole window's decoding replaces the provisional caption
    path = tmp_path / "grown.wav"
    sf.write(path, np.concatenate([first, second]), 48000, subtype="PCM_16")
    final = engine4.submit(TranscribeRequest(path, timestamps=True, known_windows=live.known)).result(600)
    plain = engine4.submit(TranscribeRequest(path, timestamps=True)).result(600)
    assert _segments(final) == _segments(plain) and final.stats.get("reused_windows", 0) >= 1
    assert _segments(live.final.transcript) == _segments(plain)  # the window's latest decoding, once


def test_provisional_captions_are_shown_apart_until_their_window_is_read_whole(qtbot, app_home):  # noqa: F811
    view = open_window(qtbot, app_home()).recording
    view.live_lines = {0: (False, [(0.0, "The quick brown fox.")]), 1: (True, [(31.0, "Please remember to send")])}
    view.show_lines()
    assert view.caption_text == "0:00  The quick brown fox.\n0:31  Please remember to send"
    assert view.provisional_lines() == ["0:31  Please remember to send"]
    view.live_lines[1] = (False, [(31.0, "Please remember to send the report.")])  # the whole window, read again
    view.show_lines()
    assert view.provisional_lines() == [] and view.caption_text.endswith("send the report.")

