"""Recording: every block PortAudio delivers is in the saved FLAC (pause drops blocks on purpose),
Stop queues the file and it is transcribed; and closing the app mid-work (recording, transcribing,
answering) then reopening it loses no job, recording or message."""

from __future__ import annotations

import threading

import numpy as np
import soundfile as sf
from app_support import app_home, open_window, row_texts, short_params, wait_answers, wait_jobs_settled  # noqa: F401
from conftest import SPEECH, synthesize

from app.queue_view import FILE, STATE
from app.recorder import PARTIAL, Recorder, recover_recordings

BLOCK = 480  # frames per callback, as PortAudio delivers them at 48 kHz (10 ms)


def _speech_48k(folder, name: str = "fox"):
    voice, rate, text = SPEECH[name]
    path = synthesize(text, folder / f"{name}-48k.wav", voice, rate, sample_rate=48000)
    samples, sr = sf.read(path, dtype="float32")
    assert sr == 48000
    return samples


def _feed(recorder: Recorder, samples: np.ndarray) -> int:
    """Deliver the samples block by block from another thread, as PortAudio's callback does."""
    def run():
        for start in range(0, len(samples), BLOCK):
            block = samples[start : start + BLOCK].reshape(-1, 1)
            recorder.callback(block, len(block), None, None)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return len(samples)


def test_recorder_keeps_every_block_and_pause_leaves_out_only_the_paused_ones(tmp_path):
    speech = _speech_48k(tmp_path)
    recorder = Recorder(tmp_path / "recordings")
    (tmp_path / "recordings").mkdir()
    partial = recorder.start(rate=48000, open_stream=False)
    assert partial.name.endswith(PARTIAL) and recorder.state == "recording"
    first = speech[: len(speech) // 2]
    _feed(recorder, first)
    recorder.pause()
    _feed(recorder, np.full(48000, 0.5, dtype=np.float32))  # a second of loud tone while paused: not kept
    recorder.resume()
    second = speech[len(speech) // 2 :]
    _feed(recorder, second)
    path = recorder.stop()  # immediately after the last block: the writer must still write all of it
    assert path.suffix == ".flac" and not path.name.endswith(PARTIAL) and path.exists()
    assert not list((tmp_path / "recordings").glob(f"*{PARTIAL}"))
    saved, rate = sf.read(path, dtype="float32")
    assert rate == 48000 and sf.info(path).format == "FLAC"
    expected = np.concatenate([first, second])
    assert saved.shape == expected.shape
    assert np.max(np.abs(saved - expected)) <= 1.0 / 32768 + 1e-6  # only 16-bit rounding
    assert recorder.state == "idle" and recorder.stop() is None

    # Nothing recorded: no file is left behind.
    empty = Recorder(tmp_path / "recordings")
    empty.start(rate=16000, open_stream=False)
    assert empty.stop() is None and len(list((tmp_path / "recordings").iterdir())) == 1


def test_no_input_device_is_said_plainly(qtbot, app_home):  # noqa: F811
    window = open_window(qtbot, app_home())
    view = window.recording
    assert view.message.text().startswith("This computer has no microphone")
    assert not view.record_button.isEnabled()
    view.record()  # even if asked, it says so instead of failing
    assert "no microphone" in view.message.text() and view.recorder.state == "idle"


def test_stop_saves_and_queues_the_recording(qtbot, app_home, tmp_path):  # noqa: F811
    speech = _speech_48k(tmp_path)
    window = open_window(qtbot, app_home())
    view = window.recording
    view.recorder.start(rate=48000, open_stream=False)
    view._update_buttons()
    assert view.stop_button.isEnabled() and view.pause_button.isEnabled()
    _feed(view.recorder, speech)
    view.stop_button.click()
    assert view.recorder.state == "idle" and "queued" in view.message.text()
    [job] = window.bridge.jobs.list()
    assert job.path.endswith(".flac") and sf.info(job.path).frames == len(speech)
    wait_jobs_settled(qtbot, window)
    job = window.bridge.jobs.get(job.id)
    assert job.state == "done", job.error
    assert "lazy dog" in job.result["text"].lower()


def test_closing_mid_work_and_reopening_loses_no_job_recording_or_message(qtbot, app_home, speech, tmp_path):  # noqa: F811
    spoken = _speech_48k(tmp_path, "report")
    settings = app_home()
    window = open_window(qtbot, settings)
    recording_started = window.recording.recorder.start(rate=48000, open_stream=False)
    _feed(window.recording.recorder, spoken)
    job_ids = window.bridge.add_paths([speech["long"], speech["fox"], speech["budget"]])
    window.chats.new_chat()
    window.chats.apply_settings(params=short_params(300))
    assert window.chats.send("Write a long story about a lighthouse keeper.")
    conversation_id = window.chats.current
    qtbot.waitUntil(lambda: len((window.bridge.answering(conversation_id) or
                                 type("x", (), {"reply": type("r", (), {"text": ""})})).reply.text) > 10, timeout=120000)
    unfinished_before_close = [j.id for j in window.bridge.jobs.list() if j.state in ("queued", "running")]
    window.close()  # mid-work: recording running, jobs in flight, an answer streaming

    from engine.chat.answering import Conversations
    from engine.jobs import JobStore

    store = JobStore()
    recordings = [j for j in store.list() if j.path.endswith(".flac")]
    assert len(recordings) == 1 and sf.info(recordings[0].path).frames == len(spoken)
    assert recordings[0].path == str(recording_started).replace(PARTIAL, ".flac")
    assert {j.id for j in store.list()} >= set(job_ids)
    assert unfinished_before_close, "nothing was left in flight: the test did not close mid-work"
    answer = Conversations().get(conversation_id).messages[-1]
    assert answer.state == "interrupted" and len(answer.content) > 10
    assert recover_recordings() == []  # the recording was finished on close, not left partial

    reopened = open_window(qtbot, app_home())
    wait_jobs_settled(qtbot, reopened, timeout=180)
    jobs = reopened.bridge.jobs.list()
    assert len(jobs) == 4 and all(j.state == "done" for j in jobs), [(j.path, j.state, j.error) for j in jobs]
    texts = {j.path.rsplit("/", 1)[-1]: j.result["text"].lower() for j in jobs}
    assert "quarterly report" in texts["long.wav"] and "lazy dog" in texts["fox.wav"]
    assert "quarterly report" in next(t for name, t in texts.items() if name.endswith(".flac"))
    assert [r[STATE] for r in row_texts(reopened.queue.table)] == ["Done"] * 4
    assert {r[FILE] for r in row_texts(reopened.queue.table)} >= {"long.wav", "fox.wav", "budget.wav"}
    reopened.chats.open(conversation_id)
    shown = reopened.chats.rendered_text()
    assert "lighthouse keeper" in shown and answer.content[:10] in shown and "interrupted" in shown
