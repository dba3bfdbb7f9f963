"""The desktop window opens offscreen and lists the models; engine/ never imports Qt."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_main_window_opens_and_lists_models(qtbot):
    from app.main_window import MainWindow

    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    assert window.windowTitle() == "Cadence"
    table = window.models_table
    names = {table.item(r, 0).text() for r in range(table.rowCount())}
    assert names == {"whisper-tiny.en", "whisper-base", "smollm2-135m-instruct"}
    assert not window.windowIcon().isNull()


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
