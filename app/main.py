"""Start the desktop app: ``cadence gui`` or ``cadence-gui``."""

from __future__ import annotations

import sys


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


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow

    argv = list(argv or [])
    app = QApplication.instance() or QApplication(["cadence", *argv])
    app.setApplicationName("Cadence")
    app.setOrganizationName("Cadence")
    app.setDesktopFileName("cadence")
    install_error_hook()
    window = MainWindow()
    window.show()
    files = [a for a in argv if not a.startswith("-")]  # opened from the file manager ("Open with Cadence")
    if files:
        window.bridge.add_paths(files)
    return app.exec()


def run() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
