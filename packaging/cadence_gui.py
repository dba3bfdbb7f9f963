"""PyInstaller's entry point for the desktop app (the same as ``cadence-gui``)."""

from app.main import run

if __name__ == "__main__":
    run()
