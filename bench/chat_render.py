"""How long the chat view takes to draw a Markdown answer as it streams, by the answer's length.

The real window (offscreen) and the real chat model answer one short question (so the conversation
has a real answer row); then a long Markdown text (prose, a table and code blocks, repeated) goes
through the same signal the stream uses, cut at growing lengths, and each redraw of the view is
timed: Markdown parsed and coloured (a streaming answer is not cached), the HTML set and laid out.
The view redraws at most every REDRAW_MS (80 ms), and waits longer when a redraw costs more than a
quarter of that (DRAW_SHARE), so this is also how often a long answer is redrawn.

    QT_QPA_PLATFORM=offscreen python bench/chat_render.py [--repeat 5]
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

BLOCK = """## Step {n}

Some prose that explains the step, with `inline code`, a [link](https://example.com) and **bold** words
that go on for a line or two, as answers do.

| Option | Speed | Memory |
|:-------|------:|:------:|
| Batched | 2.4x | 1.1 GB |
| Serial | 1.0x | 0.9 GB |

```python
def transcribe(path: str) -> str:
    \"\"\"Return the text of one file.\"\"\"
    with Engine() as engine:
        return engine.transcribe(path).text  # step {n}
```

- a bullet
- another bullet

"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="redraws timed per length (the median is shown)")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    home = Path(tempfile.mkdtemp(prefix="cadence-chat-render-"))
    os.environ["CADENCE_DATA_DIR"] = str(home / "data")

    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(["cadence"])
    from app.chat_view import DRAW_SHARE, REDRAW_MS
    from app.main_window import MainWindow
    from app.settings import Settings
    from engine.sampling import SamplingParams

    settings = Settings(home / "settings.ini")
    settings.first_run_done = True
    window = MainWindow(settings)
    window.resize(1280, 800)
    window.show()
    window.tabs.setCurrentWidget(window.chats)
    chats = window.chats
    conversation_id = chats.new_chat()
    chats.apply_settings(params=SamplingParams(max_tokens=8))
    chats.send("Hello")
    while window.bridge.live_replies:
        app.processEvents()
        time.sleep(0.01)
    answer = window.bridge.conversations.get(conversation_id).messages[-1]
    text = "".join(BLOCK.format(n=n) for n in range(40))
    print(f"{'markdown chars':>14} {'code blocks':>11} {'redraw ms':>9} {'redraws/s':>9}")
    for chars in (500, 2000, 8000, 16000, len(text)):
        piece = text[:chars]
        times = []
        for i in range(args.repeat):
            window.bridge.reply_update.emit(conversation_id, answer.id, piece + " " * i, 30.0)  # new text each time
            t0 = time.perf_counter()
            chats._draw()
            times.append((time.perf_counter() - t0) * 1000)
            app.processEvents()
        ms = statistics.median(times)
        rate = 1000 / max(REDRAW_MS, ms / DRAW_SHARE)
        print(f"{chars:>14} {piece.count('```python'):>11} {ms:>9.1f} {rate:>9.1f}")
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
