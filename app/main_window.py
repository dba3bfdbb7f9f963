"""The main window: transcription and chat tabs, and a status bar naming the models in use."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import (
    QLabel,
    QMainWindow,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.backend import available_backends
from engine.models import list_models

from app.resources import icon_path


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("Cadence")
        self.setWindowIcon(QIcon(str(icon_path())))
        self.resize(960, 640)
        self.tabs = QTabWidget()
        self.tabs.addTab(self._models_tab(), "Models")
        self.setCentralWidget(self.tabs)
        self.statusBar().showMessage(f"Backends here: {', '.join(available_backends())}")

    def _models_tab(self) -> QWidget:
        page = QWidget()
        layout = QVBoxLayout(page)
        intro = QLabel("Models Cadence can run on this machine. Transcription and chat arrive with the engine.")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        rows = list_models()
        self.models_table = QTableWidget(len(rows), 4)
        self.models_table.setHorizontalHeaderLabels(["Model", "Kind", "Available", "Source"])
        for i, row in enumerate(rows):
            values = [row["name"], row["family"], "yes" if row["available"] else "no", row["source"]]
            for j, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setFlags(item.flags() & ~Qt.ItemIsEditable)
                if not row["available"]:
                    item.setToolTip(row["detail"])
                self.models_table.setItem(i, j, item)
        self.models_table.resizeColumnsToContents()
        layout.addWidget(self.models_table)
        return page
