"""Start the desktop app: ``cadence gui`` or ``cadence-gui``."""

from __future__ import annotations

import os
import sys
import tempfile


def install_error_hook() -> None:
    """An unexpected error in the window becomes one sentence in the status bar (the traceback goes to
    the fault log), never a crash or a traceback on screen."""
    from PySide6.QtWidgets import QApplication, QMainWindow

    from engine.errors import CadenceError, record_fault

    def hook(kind, exc, tb):
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, exc, tb)
            return
        if isinstance(exc, CadenceError):
            sentence = str(exc)
        else:
            sentence = f"Something went wrong ({kind.__name__}: {exc}); details are in {record_fault(exc)}."
        for widget in QApplication.topLevelWidgets():
            if isinstance(widget, QMainWindow) and widget.isVisible():
                widget.statusBar().showMessage(sentence, 20000)
                return
        sys.stderr.write(sentence + "\n")

    sys.excepthook = hook


USAGE = """usage: cadence-gui [FILE ...]

Open the Cadence window; audio or video files named here are queued for transcription at once.

options:
  -h, --help          show this message and exit
  --check [FILE]      start the window, list the models this installation can use offline, and if a
                      FILE is given transcribe it and print the text; then quit (exit status 0 when all
                      went well). Run it with QT_QPA_PLATFORM=offscreen where there is no display.
"""


def check(window, app, files: list[str], limit_s: float = 600) -> int:
    """The scripted start behind ``--check``: a packaged build proves it opens, finds its bundled models
    and transcribes offline, without anyone looking at the window."""
    import time

    from engine.models import list_models

    models = [m["name"] for m in list_models() if m["available"]]
    print("models: " + (", ".join(models) or "none"), flush=True)
    ids = window.bridge.add_paths(files) if files else []
    end = time.monotonic() + limit_s
    while window.bridge.transcribing and time.monotonic() < end:
        app.processEvents()
        time.sleep(0.02)
    ok = bool(models)
    for job_id in ids:
        job = window.bridge.jobs.get(job_id)
        if job.state == "done":
            print(f"{job.path}: {job.result.get('text', '')}", flush=True)
        else:
            print(f"{job.path}: {job.state}{': ' + job.error if job.error else ''}", flush=True)
            ok = False
    window.close()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "-h" in argv or "--help" in argv:
        print(USAGE, end="")
        return 0
    checking = "--check" in argv
    if checking and not os.environ.get("CADENCE_DATA_DIR"):  # a check leaves the person's queue alone
        os.environ["CADENCE_DATA_DIR"] = tempfile.mkdtemp(prefix="cadence-check-")
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow

    app = QApplication.instance() or QApplication(["cadence", *argv])
    app.setApplicationName("Cadence")
    app.setOrganizationName("Cadence")
    app.setDesktopFileName("cadence")
    install_error_hook()
    window = MainWindow()
    window.show()
    files = [a for a in argv if not a.startswith("-")]  # opened from the file manager ("Open with Cadence")
    if checking:
        return check(window, app, files)
    if files:
        window.bridge.add_paths(files)
    return app.exec()


def run() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
