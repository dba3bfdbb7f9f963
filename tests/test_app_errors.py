"""Errors where people look: an engine fault (here: the store changed under a running job, so the
engine thread's write of a window fails) fails that file with one sentence and leaves the window working; an
unexpected error in the window becomes one sentence in the status bar, its traceback in faults.log."""

from __future__ import annotations

import sqlite3
import sys

from app_support import app_home, open_window, wait_jobs_settled  # noqa: F401


def test_an_engine_fault_neither_freezes_nor_kills_the_window(qtbot, app_home, speech):  # noqa: F811
    window = open_window(qtbot, app_home())
    problems = []
    window.bridge.problem.connect(problems.append)
    [doomed] = window.bridge.add_paths([speech["long"]])
    with sqlite3.connect(window.bridge.jobs.path) as db:  # another program deletes the job mid-work
        db.execute("DELETE FROM jobs WHERE id = ?", (doomed,))
    wait_jobs_settled(qtbot, window)
    # The engine fails that file alone (its window could not be recorded); the sentence names it once.
    assert problems and problems[-1].startswith("long.wav: its progress could not be recorded"), problems
    assert "Traceback" not in problems[-1] and problems[-1].endswith("faults.log.")
    assert str(speech["long"]) not in problems[-1]
    assert window.statusBar().currentMessage() == problems[-1]
    assert window.queue.table.rowCount() == 0

    [job_id] = window.bridge.add_paths([speech["fox"]])  # the window and the engine go on working
    wait_jobs_settled(qtbot, window)
    assert window.bridge.jobs.get(job_id).state == "done"


def test_an_unexpected_error_is_one_sentence_in_the_status_bar(qtbot, app_home):  # noqa: F811
    from app.main import install_error_hook
    from engine.paths import data_dir

    window = open_window(qtbot, app_home())
    saved = sys.excepthook
    install_error_hook()
    try:
        try:
            {}["missing"]
        except KeyError as exc:
            sys.excepthook(KeyError, exc, exc.__traceback__)
    finally:
        sys.excepthook = saved
    shown = window.statusBar().currentMessage()
    assert shown.startswith("Something went wrong (KeyError: 'missing')") and "\n" not in shown
    assert "Traceback" in (data_dir() / "faults.log").read_text()
