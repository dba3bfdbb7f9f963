"""How long the window's event loop blocks while the engine decodes 8 chats and the panel draws them.

The real window (offscreen), the real chat model, a data folder and settings of its own. A timer
ticks every 10 ms on the window's thread; the longest gap between ticks (minus nothing: the
interval is part of it) is the longest time a person could have waited for the window to react.
Each run starts 8 chats one after another, shows the chat, queue and engine views in turn while
they stream, and waits for all 8 answers. The test suite only checks that the window never
freezes (tests/test_app_chat.py); this measures it.

    QT_QPA_PLATFORM=offscreen python bench/ui_latency.py [--runs 3] [--tokens 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=40, help="max tokens per answer")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    home = Path(tempfile.mkdtemp(prefix="cadence-ui-latency-"))
    os.environ["CADENCE_DATA_DIR"] = str(home / "data")

    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(["cadence"])
    from app.heartbeat import Heartbeat
    from app.main_window import MainWindow
    from app.settings import Settings
    from engine.sampling import SamplingParams

    def pump(until, limit: float = 600.0) -> None:
        stop = time.monotonic() + limit
        while not until() and time.monotonic() < stop:
            app.processEvents()
            time.sleep(0.002)

    def wait(seconds: float) -> None:
        end = time.monotonic() + seconds
        pump(lambda: time.monotonic() >= end)

    settings = Settings(home / "settings.ini")
    settings.first_run_done = True
    settings.max_width = 8
    window = MainWindow(settings)
    window.resize(1280, 800)
    window.show()
    chats = window.chats

    def chat(prompt: str, tokens: int) -> None:
        chats.new_chat()
        chats.apply_settings(params=SamplingParams(max_tokens=tokens))
        chats.send(prompt)

    chat("Hi", 4)  # load the model and calibrate before measuring
    pump(lambda: not window.bridge.live_replies)
    gaps, ticks = [], []
    for run in range(args.runs):
        beat = Heartbeat(10)
        beat.start()
        for i in range(8):
            chat(f"Count from {i} to {i + 30}, one number per line.", args.tokens)
            wait(0.03)
        for view in (window.chats, window.tabs.widget(0), window.engine_panel):
            window.tabs.setCurrentWidget(view)
            wait(0.7)
        pump(lambda: not window.bridge.live_replies)
        beat.stop()
        gaps.append(beat.longest * 1000)
        ticks.append(beat.ticks)
        print(f"run {run + 1}: longest event-loop gap {gaps[-1]:.1f} ms over {beat.ticks} ticks", flush=True)
    window.close()
    print(f"longest gap: median {statistics.median(gaps):.1f} ms, max {max(gaps):.1f} ms over {args.runs} runs "
          f"(8 chats of {args.tokens} tokens, a 10-ms timer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
