"""The settings panel: choices are stored with QSettings, backends absent here cannot be chosen, and
engine settings apply without a restart (at once when idle, else when the current work ends)."""

from __future__ import annotations

import torch
from app_support import app_home, open_window, short_params, wait_answers, wait_jobs_settled  # noqa: F401


def test_settings_persist_and_apply_without_restart(qtbot, app_home, speech, tmp_path):  # noqa: F811
    window = open_window(qtbot, app_home(max_width=4))
    panel = window.settings_panel
    backends = {panel.backend.itemData(i): panel.backend.model().item(i).isEnabled() for i in range(panel.backend.count())}
    assert backends["auto"] and backends["cpu"]
    assert backends["cuda"] == torch.cuda.is_available()
    assert "Detected:" in panel.detected.text()

    # Idle engine: batching off applies at once (a new engine), outputs apply to new files.
    old_engine = window.bridge.engine
    panel.batching.setChecked(False)
    panel.drafter.setCurrentIndex(panel.drafter.findData("off"))
    for fmt, box in panel.formats.items():
        box.setChecked(fmt in ("txt", "vtt"))
    out = tmp_path / "transcripts"
    panel.output_folder.setText(str(out))
    assert panel.windowing.currentData() == "vad"  # the default: windows cut in pauses
    panel.windowing.setCurrentIndex(panel.windowing.findData("fixed"))
    note = panel.apply()
    assert "are in use" in note
    assert window.bridge.engine is not old_engine and window.bridge.engine.status()["batch"] == "off"
    assert window.bridge.engine.status().get("drafter", "off") == "off"  # passed on where the engine drafts

    reread = app_home()  # a fresh QSettings on the same file: what the next start reads
    assert reread.batching is False and reread.output_formats == ["txt", "vtt"] and reread.output_folder == str(out)
    assert reread.windowing == "fixed"
    assert reread.engine_choice().batch == "off"

    [job_id] = window.bridge.add_paths([speech["fox"]])
    wait_jobs_settled(qtbot, window)
    assert window.bridge.jobs.get(job_id).state == "done"
    assert window.bridge.jobs.get(job_id).options["windowing"] == "fixed"  # the file was cut as chosen
    assert (out / "fox.vtt").read_text().startswith("WEBVTT") and (out / "fox.txt").exists()
    assert not (out / "fox.srt").exists()
    assert window.bridge.engine.status()["lanes"]["whisper-tiny.en"]["width"] == 1
    # Batching and drafting off: nothing was measured, and the engine panel says so instead of a curve.
    assert window.bridge.engine.status()["lanes"]["whisper-tiny.en"]["calibration"] is None
    qtbot.waitUntil(lambda: window.engine_panel.lane_name == "whisper-tiny.en"
                    and window.engine_panel.calibration_drawn["note"].startswith("Not measured"), timeout=5000)
    assert window.engine_panel.calibration_drawn["widths"] == [] and window.engine_panel.calibration_drawn["in_use"] is None

    # Busy engine: the change waits for the current work, then applies by itself.
    conversation_id = window.chats.new_chat()
    window.chats.apply_settings(params=short_params(60))
    assert window.chats.send("Tell me about the moon.")
    # Each chat lane's slot length shows in Settings: on auto, the model's own context (memory allows it here).
    qtbot.waitUntil(lambda: "smollm2-135m-instruct: 8192 tokens per slot, the model handles 8192 (the model)"
                    in panel.context_note.text(), timeout=120000)
    panel.batching.setChecked(True)
    panel.max_width.setValue(3)
    panel.drafter.setCurrentIndex(panel.drafter.findData("ngram"))
    panel.context.setValue(1024)
    note = panel.apply()
    assert "as soon as the current work finishes" in note
    busy_engine = window.bridge.engine
    wait_answers(qtbot, window)
    qtbot.waitUntil(lambda: window.bridge.engine is not busy_engine, timeout=10000)
    assert window.bridge.engine.status()["batch"] == 3
    assert window.bridge.engine.status().get("drafter", "ngram") == "ngram"
    assert app_home().drafter == "ngram" and app_home().max_width == 3
    assert window.bridge.engine.status()["context"] == 1024 and app_home().context == 1024
    assert window.bridge.conversations.get(conversation_id).messages[-1].state == "complete"
    qtbot.waitUntil(lambda: "new settings" in panel.note.text(), timeout=5000)
