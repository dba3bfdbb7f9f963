"""Start the desktop app: ``cadence gui`` or ``cadence-gui``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow

    app = QApplication.instance() or QApplication(["cadence", *(argv or [])])
    app.setApplicationName("Cadence")
    app.setOrganizationName("Cadence")
    window = MainWindow()
    window.show()
    return app.exec()


def run() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
