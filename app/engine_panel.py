"""The live engine panel: what every slot is doing, drawn from ``Engine.status()`` snapshots.

Fed by :class:`app.bridge.EngineBridge` four times a second. Per lane (one per model): the width in
use and where it came from, the calibration curve with the chosen width, busy slots, step time,
tokens per second over time, and per slot its tokens per second, its draft acceptance and which
request sits in it. Drafting keys (``drafting`` per lane, with the planner's note when it found no draft
worth its time; ``drafted``/``accepted``/``depth`` per slot) are read when the engine provides them.
Drawing reuses the same plot items (``setData``), so it stays cheap with every slot busy. A server's
engine (snapshots from app.remote_status: its /slots and /metrics) is drawn the same way, with a line
saying what that server does not report.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QGraphicsItem,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

HISTORY = 240  # samples kept for the time plots (a minute at 4 per second)
SLOT_COLUMNS = ["Slot", "Request", "Tokens", "Context", "tok/s", "Drafts kept", "State"]

pg.setConfigOptions(antialias=False, background="w", foreground="k")


def _acceptance(drafted, accepted) -> float | None:
    try:
        drafted, accepted = float(drafted or 0), float(accepted or 0)
    except (TypeError, ValueError):
        return None
    return accepted / drafted if drafted > 0 else None


class EnginePanel(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.lane_name: str | None = None
        self._lane_chosen_by_user = False
        self.samples = 0  # snapshots received (tests and the status line read it)
        self.last_status: dict = {}
        self._last_slots: dict[tuple[str, int], tuple[object, int, float]] = {}  # (lane, slot) -> (request, tokens, t)
        self.slot_tok_s: dict[tuple[str, int], float] = {}
        self._history_t: deque = deque(maxlen=HISTORY)
        self._history_tok_s: deque = deque(maxlen=HISTORY)
        self._history_step_ms: deque = deque(maxlen=HISTORY)
        self._history_busy: deque = deque(maxlen=HISTORY)
        self._last_tokens: dict[str, tuple[int, float]] = {}
        self._t0 = time.monotonic()
        self._drawn_calibration: tuple | None = None
        self._slot_top = 1.0
        self._busy_top = 0

        self.summary = QLabel("The engine has not loaded a model yet: start a transcription or a chat.")
        self.summary.setWordWrap(True)
        self.lane_box = QComboBox()
        self.lane_box.currentTextChanged.connect(self._choose_lane)
        self.lane_info = QLabel()
        self.lane_info.setWordWrap(True)
        self.precision_info = QLabel()  # which precision the lane runs in, and why
        self.precision_info.setWordWrap(True)
        self.server_info = QLabel()  # a server's engine: what it does not report, or why it cannot be asked
        self.server_info.setWordWrap(True)
        self.server_info.hide()

        self.slot_plot = pg.PlotWidget(title="Tokens per second, per slot")
        self.slot_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush="#3b7dd8")
        self.slot_plot.addItem(self.slot_bars)
        self.slot_plot.setLabel("bottom", "slot")
        self.accept_plot = pg.PlotWidget(title="Draft acceptance, per slot (line: lane)")
        self.accept_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush="#3aa657")
        self.accept_plot.addItem(self.accept_bars)
        self.accept_lane_line = pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen("#c0392b", width=2))
        self.accept_plot.addItem(self.accept_lane_line)
        self.accept_plot.setYRange(0, 1)
        self.time_plot = pg.PlotWidget(title="Lane: tokens per second")
        self.tok_curve = self.time_plot.plot(pen=pg.mkPen("#3b7dd8", width=2))
        self.time_plot.setLabel("bottom", "seconds")
        self.busy_plot = pg.PlotWidget(title="Busy slots")
        self.busy_curve = self.busy_plot.plot(pen=pg.mkPen("#3aa657", width=2), stepMode=None)
        self.busy_plot.setLabel("bottom", "seconds")
        self.step_plot = pg.PlotWidget(title="Step time (ms)")
        self.step_curve = self.step_plot.plot(pen=pg.mkPen("#8e44ad", width=2))
        self.step_plot.setLabel("bottom", "seconds")
        self.calibration_plot = pg.PlotWidget(title="Calibration: tokens/s by width")
        self.calibration_curve = self.calibration_plot.plot(pen=pg.mkPen("#3b7dd8", width=2), symbol="o", symbolSize=6)
        self.calibration_chosen = pg.ScatterPlotItem(size=12, brush="#c0392b")
        self.calibration_plot.addItem(self.calibration_chosen)
        self.calibration_in_use = pg.InfiniteLine(pos=0, angle=90, pen=pg.mkPen("#555555", width=1, style=Qt.DashLine))
        self.calibration_in_use.setVisible(False)
        self.calibration_plot.addItem(self.calibration_in_use)
        self.calibration_plot.setLabel("bottom", "width (red: chosen, dashed: in use)")
        self.calibration_note = pg.TextItem("", color="#666666", anchor=(0.5, 0.5))
        self.calibration_plot.addItem(self.calibration_note)
        self.calibration_note.setPos(0.5, 0.5)
        for plot in (self.slot_plot, self.accept_plot, self.busy_plot, self.calibration_plot):
            plot.enableAutoRange(axis="y", enable=False)
        self.slot_plot.setYRange(0, 1)
        self.busy_plot.setYRange(0, 1)
        for plot in (self.slot_plot, self.accept_plot, self.time_plot, self.busy_plot, self.step_plot,
                     self.calibration_plot):
            # Axes and titles are drawn once into a pixmap and only redrawn when their range changes:
            # this halves the cost of each update (text is the expensive part of a plot).
            for axis in ("left", "bottom"):
                plot.getAxis(axis).setCacheMode(QGraphicsItem.DeviceCoordinateCache)
            plot.getPlotItem().titleLabel.setCacheMode(QGraphicsItem.DeviceCoordinateCache)
            plot.setMenuEnabled(False)
            plot.setMinimumHeight(150)
            plot.showGrid(x=False, y=True, alpha=0.3)

        self.slots_table = QTableWidget(0, len(SLOT_COLUMNS))
        self.slots_table.setHorizontalHeaderLabels(SLOT_COLUMNS)
        self.slots_table.verticalHeader().setVisible(False)
        self.slots_table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        header = self.slots_table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.Fixed)  # sizing to contents re-measures every cell on each change
        header.setSectionResizeMode(1, QHeaderView.Stretch)
        for column, width in enumerate((40, 0, 60, 65, 60, 120, 80)):
            if width:
                self.slots_table.setColumnWidth(column, width)
        self.slots_table.setMinimumHeight(120)
        self.slots_table.verticalHeader().setDefaultSectionSize(20)

        top = QHBoxLayout()
        top.addWidget(QLabel("Lane:"))
        top.addWidget(self.lane_box)
        top.addWidget(self.lane_info, 1)
        grid = QGridLayout()
        grid.addWidget(self.slot_plot, 0, 0)
        grid.addWidget(self.accept_plot, 0, 1)
        grid.addWidget(self.calibration_plot, 0, 2)
        grid.addWidget(self.time_plot, 1, 0)
        grid.addWidget(self.busy_plot, 1, 1)
        grid.addWidget(self.step_plot, 1, 2)
        grid.addWidget(self.slots_table, 2, 0, 1, 3)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.server_info)
        layout.addLayout(top)
        layout.addWidget(self.precision_info)
        layout.addLayout(grid, 1)

    # ------------------------------------------------------------------ data in
    def _choose_lane(self, name: str) -> None:
        """A person picked a lane in the box: keep showing it."""
        self._lane_chosen_by_user = True
        self._show_lane(name)

    def _show_lane(self, name: str) -> None:
        if self.lane_box.currentText() != name:
            self.lane_box.blockSignals(True)
            self.lane_box.setCurrentText(name)
            self.lane_box.blockSignals(False)
        self.lane_name = name or None
        self._history_t.clear()
        self._history_tok_s.clear()
        self._history_step_ms.clear()
        self._history_busy.clear()

    def update_status(self, status: dict) -> None:
        """Take one Engine.status() snapshot (plus the bridge's 'labels')."""
        self.samples += 1
        self.last_status = status
        now = float(status.get("sampled_at") or time.monotonic())
        lanes = status.get("lanes") or {}
        batch = status.get("batch")
        remote = status.get("remote")
        if remote:  # a server's: what it reports, and in one sentence what it does not (or why it cannot be asked)
            self.summary.setText(remote["summary"] + f" · {len(lanes)} model{'s' if len(lanes) != 1 else ''} reported")
            self.server_info.setText(remote.get("error") or remote["missing"])
            style = "color: #b00020" if remote.get("error") else "color: #666666"
            if self.server_info.styleSheet() != style:
                self.server_info.setStyleSheet(style)
        else:
            self.summary.setText(f"Backend: {status.get('backend_name', status.get('backend', '?'))} · batching: "
                                 f"{'off' if batch == 'off' else batch} (from {status.get('batch_from', '?')}) · "
                                 + (f"drafter: {status['drafter']} · " if status.get("drafter") else "") +
                                 f"{len(lanes)} model{'s' if len(lanes) != 1 else ''} loaded")
        self.server_info.setVisible(bool(remote))
        names = list(lanes)
        if [self.lane_box.itemText(i) for i in range(self.lane_box.count())] != names:
            self.lane_box.blockSignals(True)
            self.lane_box.clear()
            self.lane_box.addItems(names)
            if self.lane_name in names:
                self.lane_box.setCurrentText(self.lane_name)
            self.lane_box.blockSignals(False)
        if names and not self._lane_chosen_by_user:  # follow the busiest lane until a person picks one
            def busy(n):
                return sum(1 for s in lanes[n].get("slots") or [] if s)

            current = busy(self.lane_name) if self.lane_name in lanes else -1
            busiest = max(names, key=busy)
            if self.lane_name not in names or busy(busiest) > current == 0:
                self._show_lane(busiest)
        for name, lane in lanes.items():
            self._measure_slots(name, lane, now)
        if self.lane_name in lanes:
            self._draw_lane(self.lane_name, lanes[self.lane_name], status.get("labels") or {}, now)

    def _measure_slots(self, name: str, lane: dict, now: float) -> None:
        for i, slot in enumerate(lane.get("slots") or []):
            key = (name, i)
            if not slot:
                self._last_slots.pop(key, None)
                self.slot_tok_s[key] = 0.0
                continue
            request, tokens = slot.get("request"), int(slot.get("tokens") or 0)
            before = self._last_slots.get(key)
            if before and before[0] == request and now > before[2] and tokens >= before[1]:
                self.slot_tok_s[key] = (tokens - before[1]) / (now - before[2])
            elif before is None or before[0] != request:
                self.slot_tok_s[key] = 0.0
            self._last_slots[key] = (request, tokens, now)

    def _draw_lane(self, name: str, lane: dict, labels: dict, now: float) -> None:
        slots = lane.get("slots") or []
        width = int(lane.get("width") or len(slots))
        busy = sum(1 for s in slots if s) if slots or not lane.get("remote") else int(lane.get("running") or 0)
        counters = lane.get("counters") or {}
        calibration = lane.get("calibration") or {}
        drafting = lane.get("drafting") or {}
        chosen = calibration.get("chosen")
        info = [f"width {width} in use ({lane.get('width_from', '?')})"]
        if chosen:
            info.append(f"calibrated choice {chosen}")
        info += [f"{busy}/{width} slots busy" if width else f"{busy} requests running",
                 f"{lane.get('waiting', 0):.0f} waiting",
                 f"step {counters.get('last_step_ms', 0):.1f} ms (mean {counters.get('mean_step_ms', 0):.1f})"
                 if not lane.get("remote") else "step time not reported by the server"]
        if drafting:
            rate = drafting.get("acceptance")
            why = (drafting.get("planner") or {}).get("note")  # only when every step it weighed drafted nothing
            info.append(f"drafter {drafting.get('drafter', '?')}: {drafting.get('state', '?')}"
                        + (f", acceptance {float(rate):.0%}" if rate is not None else "") + (f", {why}" if why else ""))
        else:
            info.append("drafting: not reported by this " + ("server" if lane.get("remote") else "engine"))
        if lane.get("precision"):
            info.append(f"precision {lane['precision']} ({lane.get('precision_from', '?')})")
        self.lane_info.setText(" · ".join(info))
        why = lane.get("precision_why")
        self.precision_info.setText(f"Precision: {why}" if why else "Precision: not reported by this "
                                    + ("server" if lane.get("remote") else "engine"))

        xs = np.arange(len(slots))
        heights = [round(self.slot_tok_s.get((name, i), 0.0), 1) for i in xs]
        self._set_bars(self.slot_bars, xs, heights)
        top = max([1.0, *heights]) * 1.15
        if abs(top - self._slot_top) > 0.2 * self._slot_top:  # rescale only on a real change (no axis churn)
            self._slot_top = top
            self.slot_plot.setYRange(0, top, padding=0)
        if self._busy_top != width:
            self._busy_top = width
            self.busy_plot.setYRange(0, width + 0.5, padding=0)
        rates = [round(_acceptance(s.get("drafted"), s.get("accepted")) or 0.0, 3) if s else 0.0 for s in slots]
        self._set_bars(self.accept_bars, xs, rates)
        lane_rate = drafting.get("acceptance")
        if lane_rate is None:
            lane_rate = _acceptance(drafting.get("drafted"), drafting.get("accepted"))
        if float(lane_rate or 0.0) != self.accept_lane_line.value():
            self.accept_lane_line.setPos(float(lane_rate or 0.0))

        tokens_total = int(counters.get("tokens") or counters.get("generated") or 0)
        before = self._last_tokens.get(name)
        lane_tok_s = (tokens_total - before[0]) / (now - before[1]) if before and now > before[1] else 0.0
        self._last_tokens[name] = (tokens_total, now)
        if lane.get("remote") and slots:  # a server counts tokens as answers finish: its slots say it live
            lane_tok_s = sum(heights)
        self._history_t.append(now - self._t0)
        self._history_tok_s.append(max(0.0, lane_tok_s))
        self._history_busy.append(busy)
        self._history_step_ms.append(float(counters.get("last_step_ms") or 0.0))
        t = np.fromiter(self._history_t, float)
        self.tok_curve.setData(t, np.fromiter(self._history_tok_s, float))
        self.busy_curve.setData(t, np.fromiter(self._history_busy, float))
        self.busy_plot.setXRange(t[0], max(t[-1], t[0] + 1), padding=0)
        self.step_curve.setData(t, np.fromiter(self._history_step_ms, float))

        self._draw_calibration(name, lane.get("calibration"), width,
                               "remote" if lane.get("remote") else lane.get("width_from", ""))
        self._fill_table(name, slots, labels)

    def _draw_calibration(self, name: str, calibration: dict | None, width: int, width_from: str) -> None:
        """The measured curve (whenever the engine reports one, also when the width was set by hand), its
        chosen width in red and the width in use as a dashed line; a note only when nothing was measured."""
        calibration = calibration if isinstance(calibration, dict) else None
        widths = list((calibration or {}).get("widths") or [])
        aggregate = list((calibration or {}).get("aggregate_tok_s") or [])
        chosen = (calibration or {}).get("chosen")
        key = (name, calibration is None, tuple(widths), tuple(aggregate), chosen, width)
        if key == self._drawn_calibration:  # static once measured: redraw only when it changes
            return
        self._drawn_calibration = key
        self.calibration_curve.setData(widths, aggregate)
        if widths and chosen in widths:
            self.calibration_chosen.setData([chosen], [aggregate[widths.index(chosen)]])
        else:
            self.calibration_chosen.setData([], [])
        if widths and aggregate:
            self.calibration_note.setText("")
            self.calibration_in_use.setPos(width)
            self.calibration_in_use.setVisible(width > 0)
            self.calibration_plot.setYRange(0, max(aggregate) * 1.1)
            self.calibration_plot.setXRange(min(*widths, width), max(*widths, width))
            return
        self.calibration_in_use.setVisible(False)
        if width_from == "remote":
            self.calibration_note.setText("Not reported by the server")
        elif calibration is None:
            why = "batching is off" if width_from == "batch off" else f"the width ({width}) was set in the settings"
            self.calibration_note.setText(f"Not measured: {why}")
        else:
            self.calibration_note.setText("The engine reported no calibration curve")
        self.calibration_plot.setXRange(0, 1)
        self.calibration_plot.setYRange(0, 1)

    @property
    def calibration_drawn(self) -> dict:
        """What the calibration plot shows now (for tests and the screenshots)."""
        xs, ys = self.calibration_curve.getData()
        red = self.calibration_chosen.getData()[0]
        return {"widths": [] if xs is None else [int(x) for x in xs], "tok_s": [] if ys is None else list(ys),
                "chosen": [int(x) for x in red] if red is not None else [],
                "in_use": int(self.calibration_in_use.value()) if self.calibration_in_use.isVisible() else None,
                "note": self.calibration_note.toPlainText()}

    @staticmethod
    def _set_bars(bars, xs, heights) -> None:
        """Redraw a bar chart only when its values changed (an idle lane costs nothing)."""
        if list(heights) != list(bars.opts.get("height") if bars.opts.get("height") is not None else []):
            bars.setOpts(x=xs, height=heights, width=0.7)

    def _fill_table(self, name: str, slots: list, labels: dict) -> None:
        table = self.slots_table
        table.setUpdatesEnabled(False)  # one repaint for the whole table, not one per changed cell
        try:
            self._fill_rows(table, name, slots, labels)
        finally:
            table.setUpdatesEnabled(True)

    def _fill_rows(self, table, name: str, slots: list, labels: dict) -> None:
        if table.rowCount() != len(slots):
            table.setRowCount(len(slots))
        for i, slot in enumerate(slots):
            if slot:
                request = slot.get("request")
                label = labels.get(request) or labels.get(str(request)) or \
                    (request if isinstance(request, str) else f"request {request}")
                if slot.get("window") is not None and "chat:" not in label:
                    label += f" (window {int(slot['window']) + 1})"
                state = "preparing" if slot.get("preparing") else "decoding"
                drafts = ""
                if slot.get("drafted"):
                    drafts = f"{slot.get('accepted', 0)}/{slot['drafted']}"
                    if slot.get("depth") is not None:
                        drafts += f" (depth {slot['depth']})"
                values = [str(i), label, str(slot.get("tokens", "")), str(slot.get("context", "")),
                          f"{self.slot_tok_s.get((name, i), 0.0):.1f}", drafts, state]
            else:
                values = [str(i), "", "", "", "", "", "free"]
            for j, value in enumerate(values):
                item = table.item(i, j)
                if item is None:
                    item = QTableWidgetItem()
                    table.setItem(i, j, item)
                if item.text() != value:
                    item.setText(value)

    # ------------------------------------------------------------------ what tests and screenshots read
    def slot_bar_heights(self) -> list[float]:
        return list(self.slot_bars.opts.get("height") or [])

    def time_points(self) -> int:
        return len(self._history_t)
