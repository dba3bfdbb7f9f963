"""The transcription queue and transcript viewer, driven through the real window offscreen: files and
a folder dropped on it are transcribed by the real engine and model, the rows show how each ended,
the transcript opens, searches, exports and starts a chat about it."""

from __future__ import annotations

import json
import shutil

from app_support import app_home, drop_files, open_window, row_texts, short_params, type_text, wait_answers  # noqa: F401
from app_support import wait_jobs_settled
from PySide6.QtCore import Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication
from parity import clip_timestamps

from app.queue_view import DURATION, FILE, MESSAGE, PROGRESS, PROGRESS_ROLE, STATE
from app.transcripts import clock


def _row_of(window, name: str) -> list[str]:
    rows = [r for r in row_texts(window.queue.table) if r[FILE] == name]
    assert len(rows) == 1, row_texts(window.queue.table)
    return rows[0]


def test_dropped_files_and_folder_are_transcribed_and_the_transcript_opens(qtbot, app_home, speech, tmp_path):  # noqa: F811
    inbox = tmp_path / "inbox"
    (inbox / "more").mkdir(parents=True)
    fox = shutil.copy(speech["fox"], inbox / "fox.wav")
    shutil.copy(speech["report"], inbox / "more" / "report.wav")
    (inbox / "more" / "notes.txt").write_text("not audio")  # not an audio name: a folder drop skips it
    broken = inbox / "broken.wav"
    broken.write_text("this is text, not audio\n")
    window = open_window(qtbot, app_home(output_formats=["txt", "srt"]))

    drop_files(window.queue, [fox, inbox / "more", broken])
    assert window.queue.table.rowCount() == 3  # rows appear at once, before any decoding
    wait_jobs_settled(qtbot, window)

    assert _row_of(window, "fox.wav")[STATE] == "Done"
    assert _row_of(window, "report.wav")[STATE] == "Done"
    bad = _row_of(window, "broken.wav")
    assert bad[STATE] == "Failed"
    assert "broken.wav" in bad[MESSAGE] and "Traceback" not in bad[MESSAGE] and bad[MESSAGE].endswith(".")
    row = window.queue.rows[window.bridge.jobs.list()[0].id]
    assert window.queue.table.item(row, PROGRESS).data(PROGRESS_ROLE) == 100
    # Outputs were saved next to each input, in every chosen format.
    assert "lazy dog" in (inbox / "fox.txt").read_text().lower()
    assert "-->" in (inbox / "fox.srt").read_text()
    assert "quarterly report" in (inbox / "more" / "report.txt").read_text().lower()

    # Open the transcript from the queue (double-click opens the same way).
    fox_job = next(j for j in window.bridge.jobs.list() if j.path.endswith("fox.wav"))
    window.queue.select_job(fox_job.id)
    assert window.queue.open_button.isEnabled()
    window.queue.open_button.click()
    view = window.transcript
    assert view.job_id == fox_job.id
    texts = [view.table.item(r, 2).text() for r in range(view.table.rowCount())]
    assert texts and "lazy dog" in " ".join(texts).lower()
    view.search.setText("lazy")
    assert view.visible_rows() and view.matches.text().startswith("1 match")
    view.search.setText("zebra crossing")
    assert view.visible_rows() == [] and view.matches.text() == "0 matches"
    view.search.clear()

    # Play from a segment: this machine has no output device, and the viewer says so.
    view.play_segment(0)
    assert view.player.position == 0.0
    assert "no audio output device" in view.note.text()

    view.copy_button.click()
    assert "lazy dog" in QApplication.clipboard().text().lower()
    out = tmp_path / "exports"
    out.mkdir()
    for fmt in ("txt", "srt", "vtt", "json"):
        assert view.export_to(out / f"fox.{fmt}") is not None
    assert (out / "fox.vtt").read_text().startswith("WEBVTT")
    assert "lazy dog" in json.loads((out / "fox.json").read_text())["text"].lower()
    assert view.export_to(out / "fox.docx") is None and "export to" in view.note.text()

    # Chat about this transcript (clicked with the mouse, then a question typed at once and sent with
    # Ctrl+Enter): a conversation whose context holds the transcript gets the question, whole, and answers it.
    window.activateWindow()
    qtbot.waitActive(window)
    qtbot.mouseClick(view.chat_button, Qt.LeftButton)
    chats = window.chats
    focused = QApplication.focusWidget()
    assert window.tabs.currentWidget() is chats
    about = chats.current
    conv = window.bridge.conversations.get(about)
    assert "lazy dog" in conv.context["transcript"]["text"].lower()
    assert conv.title == "About fox.wav"
    assert chats.apply_settings(params=short_params())
    question = "Who jumps over the lazy dog?"
    type_text(question)  # the suggested question is replaced by what is typed
    QTest.keyClick(QApplication.focusWidget(), Qt.Key_Return, Qt.ControlModifier)  # the Send shortcut
    qtbot.waitUntil(lambda: bool(window.bridge.live_replies), timeout=5000)
    wait_answers(qtbot, window, timeout=300)
    assert [c["id"] for c in window.bridge.conversations.list()] == [about]  # no other conversation began
    conv = window.bridge.conversations.get(about)
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[0].content == question
    assert focused is chats.input  # where the question went: the new conversation's input had the focus
    assert conv.messages[1].state == "complete" and conv.messages[1].content.strip()
    # The answer was written with the transcript in its context (fitted into the system prompt).
    assert conv.context["transcript"]["parts_used"] >= 1 and "lazy dog" in conv.system.lower()


def test_cancel_retry_remove_and_a_model_that_cannot_load(qtbot, app_home, speech):  # noqa: F811
    window = open_window(qtbot, app_home())
    [job_id] = window.bridge.add_paths([speech["long"]])
    window.queue.select_job(job_id)
    assert window.queue.cancel_button.isEnabled()
    window.queue.cancel_button.click()
    wait_jobs_settled(qtbot, window)
    assert window.bridge.jobs.get(job_id).state == "cancelled"
    assert _row_of(window, "long.wav")[STATE] == "Cancelled"

    window.queue.select_job(job_id)
    assert window.queue.retry_button.isEnabled(), (window.queue.selected_jobs(), job_id, window.bridge.jobs.get(job_id).state)
    window.queue.retry_button.click()
    wait_jobs_settled(qtbot, window)
    job = window.bridge.jobs.get(job_id)
    assert job.state == "done" and job.windows_total == 2
    assert "quarterly report" in job.result["text"].lower()

    window.queue.select_job(job_id)
    window.queue.remove_button.click()
    assert window.queue.table.rowCount() == 0 and window.bridge.jobs.list() == []

    # A model that cannot be loaded: the row says why, in one sentence; the window goes on.
    window.settings.transcription_model = "whisper-nonexistent"
    [bad] = window.bridge.add_paths([speech["fox"]])
    wait_jobs_settled(qtbot, window)
    row = _row_of(window, "fox.wav")
    assert row[STATE] == "Failed"
    assert "whisper-nonexistent" in row[MESSAGE] and "\n" not in row[MESSAGE]


def test_a_large_batch_is_queued_off_the_window_thread_and_fed_a_few_at_a_time(qtbot, app_home, speech, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    import app.bridge

    monkeypatch.setattr(app.bridge, "ADD_AT_ONCE", 4)  # small numbers, so a short test shows the large-batch path
    monkeypatch.setattr(app.bridge, "MAX_JOBS_IN_ENGINE", 3)
    folder = tmp_path / "batch"
    folder.mkdir()
    for i in range(10):
        shutil.copy(speech["weather" if i % 2 else "fox"], folder / f"clip{i:02d}.wav")
    window = open_window(qtbot, app_home())
    most_in_engine, queued_rows_seen = [0], [False]

    def watch(*_):
        most_in_engine[0] = max(most_in_engine[0], len(window.bridge.live_jobs))
        queued_rows_seen[0] |= any(r[STATE] == "Queued" for r in row_texts(window.queue.table))

    window.bridge.job_changed.connect(watch)
    assert window.bridge.add_paths([folder]) == []  # more than ADD_AT_ONCE files: queued on a thread
    qtbot.waitUntil(lambda: window.queue.table.rowCount() == 10, timeout=20000)
    wait_jobs_settled(qtbot, window)
    assert 1 <= most_in_engine[0] <= 3 and queued_rows_seen[0]
    jobs = window.bridge.jobs.list()
    assert len(jobs) == 10 and all(j.state == "done" for j in jobs)
    assert [j.path.rsplit("/", 1)[-1] for j in jobs] == [f"clip{i:02d}.wav" for i in range(10)]
    assert window.queue.summary.text() == "10 files: 10 done"


def test_a_file_being_transcribed_shows_each_window_as_it_finishes(qtbot, app_home, speech):  # noqa: F811
    window = open_window(qtbot, app_home())
    view, queue = window.transcript, window.queue
    seen = []  # at each window's arrival: (index, its text, the row's message, the viewer's lines, the bar)

    def on_text(job_id, index, text):  # connected after the queue and the viewer: they have drawn it already
        row = row_texts(queue.table)[queue.rows[job_id]]
        lines = [view.table.item(r, 2).text() for r in range(view.table.rowCount())]
        starts = [view.table.item(r, 0).text() for r in range(view.table.rowCount())]
        seen.append((index, text, row[MESSAGE], lines, queue.progress_of(job_id), starts))

    [job_id] = window.bridge.add_paths([speech["long"]])  # about 45 s: two windows
    window.bridge.job_text.connect(on_text)
    queue.select_job(job_id)
    assert queue.open_button.isEnabled()  # a file in flight can be opened too ...
    queue.open_button.click()  # ... and the viewer follows it live
    assert view.partial and view.job_id == job_id and view.table.rowCount() == 0
    assert "transcribing" in view.title.text() and not view.export_button.isEnabled()
    wait_jobs_settled(qtbot, window)

    assert sorted(index for index, *_ in seen) == [0, 1] and all(text for _, text, *_ in seen)
    job = window.bridge.jobs.get(job_id)
    phrases = job.result["segments"]  # the phrases the model timed, not the two windows
    assert len(phrases) > 2 and " ".join(p["text"] for p in phrases) == job.result["text"]
    first, end0, second, end1 = clip_timestamps(speech["long"])  # the second window starts in a pause, wherever it is
    assert 20 <= second
    spans = {0: (first, end0), 1: (second, end1)}
    first_index, first_text, first_message, first_lines, first_bar, first_starts = seen[0]
    # Before the file ended, the row showed the first finished window's text and the viewer its timed phrases.
    # (Either window may finish first: on a wide lane the short second one does, and it holds one phrase.)
    in_first = [p for p in phrases if spans[first_index][0] <= p["start"] < spans[first_index][1]]
    assert first_message == first_text and first_lines == [p["text"] for p in in_first] and in_first
    assert first_starts == [clock(p["start"]) for p in in_first]
    assert first_bar == (50, "50% (1/2)")  # the bar moved with the first window, not only at the end
    by_index = dict((index, text) for index, text, *_ in seen)
    assert seen[1][2] == f"{by_index[0]} {by_index[1]}"  # the row: both windows, in time order
    assert seen[1][3] == [p["text"] for p in phrases] and seen[1][5] == [clock(p["start"]) for p in phrases]
    assert job.state == "done" and job.result["text"] == f"{by_index[0]} {by_index[1]}"
    # The finished transcript replaced the live lines in the viewer; the row shows the finished figures.
    assert not view.partial and view.result == job.result and view.export_button.isEnabled()
    assert [view.table.item(r, 2).text() for r in range(view.table.rowCount())] == [p["text"] for p in phrases]
    assert view.table.item(1, 0).text() == clock(phrases[1]["start"])
    assert _row_of(window, "long.wav")[MESSAGE].endswith("real time") and queue.progress_of(job_id) == (100, "100%")


def test_files_still_waiting_show_their_duration_read_from_the_header(qtbot, app_home, speech, tmp_path,  # noqa: F811
                                                                       monkeypatch):
    import av
    import numpy as np

    import app.bridge
    from engine.audio import load_audio

    monkeypatch.setattr(app.bridge, "MAX_JOBS_IN_ENGINE", 0)  # nothing reaches the engine: every file waits
    samples = load_audio(speech["long"])
    m4a = tmp_path / "long.m4a"  # AAC in MP4: not a libsndfile format, so its length comes from PyAV
    with av.open(str(m4a), "w") as out:
        stream = out.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    window = open_window(qtbot, app_home())
    ids = window.bridge.add_paths([speech["long"], m4a, tmp_path / "gone.wav"])
    expected = clock(samples.size / 16000)
    qtbot.waitUntil(lambda: [r[DURATION] for r in row_texts(window.queue.table)][:2] == [expected, expected],
                    timeout=10000)
    assert [window.bridge.jobs.get(i).duration for i in ids[:2]] == [None, None]  # not decoded: read from headers
    assert [r[STATE] for r in row_texts(window.queue.table)][:2] == ["Queued", "Queued"]
    assert window.bridge.jobs.get(ids[2]).state == "queued" and row_texts(window.queue.table)[2][DURATION] == ""
