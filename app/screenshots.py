"""A scripted session that saves a PNG of each main view: ``make screenshots`` (under Xvfb).

It uses a fresh data folder and settings file of its own (your data is not touched), speaks a few
sentences with espeak-ng, drops them on the queue, chats, and photographs each view while the
engine works. Usage: ``python -m app.screenshots [OUTPUT_FOLDER [NAME ...]]`` (default
docs/screenshots; NAMEs: only those pictures, of transcribe, chats, chat-markdown, engine, settings,
record).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SENTENCES = {
    "standup.wav": ("en-us+f3", 140, "Good morning everyone. Yesterday we finished the billing migration. Today I will "
                    "review the budget numbers and send the quarterly report to the finance team by Friday."),
    "interview.wav": ("en-us+m3", 150, "Thank you for coming in. Tell me about a project you are proud of, and what you "
                      "would do differently if you started it again tomorrow."),
    "weather.wav": ("en-us+f3", 135, "Tomorrow will be cloudy with a chance of rain in the afternoon, so bring an umbrella."),
}


def speak(folder: Path) -> list[Path]:
    out = []
    for name, (voice, rate, text) in SENTENCES.items():
        raw, path = folder / f"raw-{name}", folder / name
        subprocess.run(["espeak-ng", "-w", str(raw), "-v", voice, "-s", str(rate), text], check=True)
        subprocess.run(["sox", "-R", str(raw), "-r", "16000", "-c", "1", str(path)], check=True)
        raw.unlink()
        out.append(path)
    long = folder / "meeting.wav"
    subprocess.run(["sox", *[str(p) for p in out * 4], str(long)], check=True)  # about 1:45: four 30-s windows
    return [*out, long]


# The Markdown picture: real answers of the chat model, one a table and one with code blocks (greedy, so
# the same each time; cut short at the length limit, since this small model repeats itself).
MARKDOWN_CHAT = [("Make a table with three planets and their sizes.", 36),
                 ("Show a Python function that adds two numbers and a bash command that runs it. Use code blocks.", 90)]
SHOTS = ("transcribe", "chats", "chat-markdown", "engine", "settings", "record")


def main(argv: list[str]) -> int:
    target = Path(argv[0] if argv else "docs/screenshots").resolve()
    wanted = set(argv[1:]) or set(SHOTS)
    if wanted - set(SHOTS):
        print(f"unknown picture(s): {', '.join(sorted(wanted - set(SHOTS)))}; choose from {', '.join(SHOTS)}")
        return 2
    target.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="cadence-screenshots-"))
    os.environ["CADENCE_DATA_DIR"] = str(home / "data")
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(["cadence"])
    app.setApplicationName("Cadence")
    from app.main_window import MainWindow
    from app.settings import Settings
    from engine.sampling import SamplingParams

    def pump(seconds: float = 0.0, until=None, limit: float = 300.0) -> None:
        end, stop = time.monotonic() + seconds, time.monotonic() + limit
        while time.monotonic() < stop:
            app.processEvents()
            if until is None and time.monotonic() >= end:
                return
            if until is not None and until():
                return
            time.sleep(0.01)

    def shot(name: str) -> None:
        pump(0.3)
        path = target / f"{name}.png"
        window.grab().save(str(path))
        print(f"saved {path}")

    settings = Settings(home / "settings.ini")
    settings.first_run_done = True
    settings.max_width = 8
    window = MainWindow(settings)
    window.resize(1280, 800)
    window.show()
    pump(0.5)
    chats = window.chats
    try:
        # Transcribe: a batch dropped on the queue; a long file mid-way, open in the viewer, its finished
        # windows' text already there while the others decode.
        if "transcribe" in wanted:
            transcribe_shot(window, speak(home), pump, shot)

        # Chats: two conversations answered at once; one open.
        if "chats" in wanted:
            window.tabs.setCurrentWidget(chats)
            prompts = ["What should a good meeting agenda contain?", "Give me three tips for writing clear emails."]
            for prompt in prompts:
                chats.new_chat()
                chats.apply_settings(params=SamplingParams(max_tokens=120))
                chats.send(prompt)
            pump(until=lambda: not window.bridge.live_replies)
            chats.open(chats.list.item(1).data(0x0100))
            shot("chats")

        # An answer drawn as Markdown: a table, code blocks coloured, each with its Copy.
        if "chat-markdown" in wanted:
            window.tabs.setCurrentWidget(chats)
            chats.new_chat()
            for prompt, tokens in MARKDOWN_CHAT:
                chats.apply_settings(params=SamplingParams(max_tokens=tokens))
                chats.send(prompt)
                pump(until=lambda: not window.bridge.live_replies, limit=900)
            pump(0.5)
            chats.view.verticalScrollBar().setValue(0)
            shot("chat-markdown")

        # Engine: eight answers decoding at once, the panel live.
        if "engine" in wanted:
            engine_shot(window, settings, pump, shot)

        if "settings" in wanted:
            window.tabs.setCurrentWidget(window.settings_panel)
            shot("settings")
        if "record" in wanted:
            window.tabs.setCurrentWidget(window.recording)
            shot("record")
    finally:
        window.close()
        shutil.rmtree(home, ignore_errors=True)
    return 0


def transcribe_shot(window, files, pump, shot) -> None:
    window.bridge.add_paths(files[:3])
    pump(until=lambda: not window.bridge.transcribing)
    [meeting, _] = window.bridge.add_paths([files[3], files[3].parent / "missing-recording.wav"])

    def part_done() -> bool:
        live = window.bridge.live_jobs.get(meeting)
        return live is not None and 0 < live.done < live.total and any(live.texts.values())

    pump(until=part_done, limit=120)
    window.open_transcript(meeting)
    window.queue.select_job(meeting)
    shot("transcribe")
    pump(until=lambda: not window.bridge.transcribing)


def engine_shot(window, settings, pump, shot) -> None:
    from engine.sampling import SamplingParams

    chats = window.chats
    window.tabs.setCurrentWidget(window.engine_panel)
    topics = ["a lighthouse", "the sea", "a city at night", "autumn", "a train journey", "the moon", "a garden",
              "a mountain"]
    for topic in topics:
        chats.new_chat()
        chats.apply_settings(params=SamplingParams(max_tokens=400))
        if not chats.send(f"Write a long story about {topic}."):
            print(f"could not start a chat: {chats.error.text()}")

    def busy_slots() -> int:
        lane = (window.bridge.last_status.get("lanes") or {}).get(settings.chat_model) or {}
        return sum(1 for slot in lane.get("slots") or [] if slot)

    pump(until=lambda: busy_slots() >= 8, limit=60)
    pump(4.0)
    shot("engine")
    pump(until=lambda: not window.bridge.live_replies)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
