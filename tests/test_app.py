"""The desktop window opens offscreen with all its views and lists the models; engine/ never imports Qt."""

import subprocess
import sys
from pathlib import Path

from app_support import app_home, open_window  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent


def test_main_window_opens_with_every_view_and_lists_models(qtbot, app_home):  # noqa: F811
    window = open_window(qtbot, app_home())
    assert window.windowTitle() == "Cadence"
    tabs = [window.tabs.tabText(i) for i in range(window.tabs.count())]
    assert tabs == ["Transcribe", "Record", "Chats", "Engine", "Settings", "Models"]
    table = window.models_table
    from engine.whisper.sizes import SIZES

    names = {table.item(r, 0).text() for r in range(table.rowCount())}
    assert names == {"whisper-tiny.en", "whisper-base", "smollm2-135m-instruct", *SIZES}
    rows = {table.item(r, 0).text(): [table.item(r, c).text() for c in range(table.columnCount())]
            for r in range(table.rowCount())}
    assert rows["whisper-large-v3"][2] == "3.1 GB" and rows["whisper-tiny.en"][3] == "yes"  # size, and here
    assert not window.windowIcon().isNull()
    # This machine has no microphone: the Record tab says so plainly and offers no Record button.
    assert "no microphone" in window.recording.message.text()
    assert not window.recording.record_button.isEnabled()


def test_first_run_names_a_missing_default_model_and_what_to_do(qtbot, app_home):  # noqa: F811
    window = open_window(qtbot, app_home(transcription_model="whisper-nonexistent"))
    assert not window.banner.isHidden()
    assert "whisper-nonexistent" in window.banner.text()
    window2_settings = app_home(transcription_model="whisper-tiny.en", first_run_done=False)
    window.close()
    window2 = open_window(qtbot, window2_settings)
    assert "offline" in window2.banner.text()


def test_engine_has_no_qt_import():
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        assert "PySide6" not in text and "PyQt" not in text, path
    code = (
        "import sys, pkgutil, importlib, engine\n"
        "for m in pkgutil.walk_packages(engine.__path__, 'engine.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "assert not any(k.startswith(('PySide6', 'PyQt')) for k in sys.modules), 'Qt imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_help_and_a_scripted_check_start_that_transcribes_offline(speech, tmp_path):
    """What `dist/cadence/cadence-gui --check FILE` runs in a packaged build: open, list models, transcribe, quit."""
    import os

    shown = subprocess.run([sys.executable, "-m", "app.main", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: cadence-gui") and "--check" in shown.stdout
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "CADENCE_DATA_DIR": str(tmp_path / "data"),
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "app.main", "--check", str(speech["fox"])], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "whisper-tiny.en" in run.stdout.splitlines()[0] and "lazy dog" in run.stdout.lower()
    missing = subprocess.run([sys.executable, "-m", "app.main", "--check", str(tmp_path / "gone.wav")], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and "gone.wav does not exist" in missing.stdout


def test_cadence_gui_queues_the_files_it_is_given(speech, tmp_path):
    """`cadence gui FILE` starts the window as `cadence-gui FILE` does, with FILE queued: run through the
    command's scripted start, the file is transcribed and its text printed."""
    import os

    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "CADENCE_DATA_DIR": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "app.cli", "gui", "--check", str(speech["fox"])], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    [line] = [line for line in run.stdout.splitlines() if line.startswith(f"{speech['fox']}: ")]
    assert "lazy dog" in line.lower()
