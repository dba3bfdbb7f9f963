"""The engine: a background thread that owns the models and their lanes.

Callers on any thread ``submit`` a request (:mod:`engine.api`) and get a :class:`~engine.api.Handle`
whose events arrive as they happen (started, delta, progress, finished, failed). The Qt app, the
CLI and the tests all use this one API. Nothing here imports Qt.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from engine.api import (
    BATCH_ENV,
    CONTEXT_ENV,
    PRECISION_ENV,
    ChatRequest,
    Handle,
    LiveHandle,
    LiveTranscribeRequest,
    TranscribeRequest,
    parse_batch,
    parse_context,
    parse_precision,
)
from engine.calibration import lane_rule
from engine.errors import CadenceError, record_fault
from engine.models import CHAT, WHISPER

STEP_STATS_ENV = "CADENCE_STEP_STATS"  # FILE.jsonl: one line per step


def _recent_rate(stamps: list[float], last: int = 16) -> float | None:
    """Tokens per second over a sequence's last few tokens (what the app graphs per slot)."""
    recent = stamps[-last:]
    if len(recent) < 2 or recent[-1] <= recent[0]:
        return None
    return round((len(recent) - 1) / (recent[-1] - recent[0]), 1)


COMMAND_BUDGET_S = 0.05  # at most this long handling commands between two steps while decoding


# ---------------------------------------------------------------------------- the engine
class Engine:
    """``batch``: 'auto' (calibrated width per model and device), 'off' (the exact single-stream
    path: one slot) or a width N. None reads CADENCE_BATCH, else 'auto'."""

    def __init__(self, backend: str = "auto", batch: str | int | None = None, step_log: str | Path | None = None,
                 drafter: str | None = None, draft_depth: int | None = None, draft_min_p: float = 0.0,
                 precision: str | None = None, context: str | int | None = None, width_rule: str = "interactive"):
        """``drafter``: 'auto' (the model's MTP head when one is shipped, else n-gram), 'mtp',
        'ngram', 'draft:MODEL' or 'off'; None reads CADENCE_DRAFTER, else 'auto'. ``draft_depth``
        fixes the drafts per slot and step (else chosen per slot, per step); ``draft_min_p`` skips
        MTP drafts the head gives less than that probability. ``precision``: 'auto' (measured per
        model and machine, see engine.precision), 'float32', 'bfloat16' or 'int8'; None reads
        CADENCE_PRECISION, else 'auto'. A precision this machine lacks is refused here. ``context``:
        positions per slot: 'auto' (the model's own context, as far as the lane's memory share allows
        at its width) or a number (at most the model's); None reads CADENCE_CONTEXT, else 'auto'.
        ``width_rule``: how 'auto' picks the width from the measured curve (engine.calibration):
        'interactive' (the app: each stream stays quick) or 'throughput' (a server: the most tokens
        per second over all streams)."""
        from engine.backend import resolve_backend
        from engine.api import DRAFTER_ENV, check_draft_limits, parse_drafter
        from engine.calibration import WIDTH_RULES
        from engine.kernels import check_precision

        self.device = resolve_backend(backend)
        chosen = precision if precision is not None else os.environ.get(PRECISION_ENV) or "auto"
        self.precision = parse_precision(chosen)
        self.precision_source = "argument" if precision is not None else (
            PRECISION_ENV if os.environ.get(PRECISION_ENV) else "default")
        if self.precision != "auto":
            check_precision(self.precision, self.device)
        if batch is None:
            self.batch, self.batch_source = parse_batch(os.environ.get(BATCH_ENV, "auto")), \
                (BATCH_ENV if os.environ.get(BATCH_ENV) else "default")
        else:
            self.batch, self.batch_source = parse_batch(batch), "argument"
        if width_rule not in WIDTH_RULES:
            raise CadenceError(f"The width rule must be one of {', '.join(WIDTH_RULES)} (got {width_rule!r}).")
        self.width_rule = width_rule
        self.context = parse_context(context if context is not None else os.environ.get(CONTEXT_ENV) or "auto")
        self.drafter = parse_drafter(drafter if drafter is not None else os.environ.get(DRAFTER_ENV, "auto"))
        check_draft_limits(draft_depth, draft_min_p)
        self.draft_depth, self.draft_min_p = draft_depth, float(draft_min_p)
        step_log = step_log or os.environ.get(STEP_STATS_ENV)
        self._step_log = open(step_log, "a", buffering=1, encoding="utf-8") if step_log else None
        self._commands: queue.Queue = queue.Queue()
        self._references: dict[str, object] = {}  # model -> its reference decoder (template, token rules)
        self._lanes: dict[str, object] = {}
        self._calibrations: dict[str, object] = {}
        self._precisions: dict[str, tuple[str, object, dict]] = {}  # model -> (precision, auto's choice or None, int8's way)
        self._contexts: dict[str, str] = {}  # model -> where its slot length comes from
        self._work: dict[int, list] = {}  # handle id -> its sequences
        # Audio files are read and planned on a thread of their own, so no slot waits for a file to decode.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadence-audio")
        # Speakers are told apart on a thread of their own, beside decoding (engine.speakers).
        self._speakers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadence-speakers")
        self._live_feed = None  # engine.whisper.live.LiveFeed, from the first live recording on
        self._live_runs: dict[int, object] = {}  # handle id -> its LiveRun
        self._reading: dict[int, Handle] = {}  # handle id -> a transcription whose audio is being read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cadence-engine", daemon=True)
        self._thread.start()

    # public API ---------------------------------------------------------------
    def submit(self, request) -> Handle:
        if self._stop.is_set():
            raise CadenceError("The engine has been shut down.")
        if isinstance(request, LiveTranscribeRequest):
            handle = self._live_handle(request)
        else:
            handle = Handle(request, on_cancel=self.cancel, on_end=self._forget)
        self._commands.put(("submit", handle))
        return handle

    def _forget(self, handle: Handle) -> None:
        """A request ended: the engine keeps nothing of it."""
        self._work.pop(handle.id, None)
        self._reading.pop(handle.id, None)
        run = self._live_runs.pop(handle.id, None)
        if run is not None:
            run.lane.release_slot(run)

    def cancel(self, handle: Handle) -> None:
        handle.cancelled = True
        self._commands.put(("cancel", handle))


    def shutdown(self, timeout: float = 30) -> None:
        self._stop.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._speakers.shutdown(wait=False, cancel_futures=True)
        if self._live_feed is not None:
            self._live_feed.shutdown()
        for handle in list(self._reading.values()):  # files still being read (or never started) when it stopped
            handle.fail("The engine was shut down.")
        # A submit that raced the stop command was queued behind it: it still gets its final event.
        while True:
            try:
                command, handle = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "submit":
                handle.fail("The engine was shut down.")
            elif command == "log" and handle is not None:
                handle.close()
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None
        if not self._thread.is_alive():  # its models go with it, even while something still holds the engine
            for store in (self._lanes, self._references, self._calibrations, self._work, self._live_runs):
                store.clear()
            from engine.backend import return_freed_memory

            return_freed_memory()

    def log_steps(self, path: str | Path | None) -> None:
        """Start writing the step log to ``path`` (appending), or stop with None."""
        new = open(path, "a", buffering=1, encoding="utf-8") if path else None
        self._commands.put(("log", new))

    def lane(self, model: str, family: str):
        """The lane of a model, loading it (and calibrating its width) on first use (engine thread only)."""
        if model not in self._lanes:
            from engine.loading import load, source_key
            from engine.scheduler import Lane

            loaded = load(model, family=family, device=self.device)
            from engine.families import decoder_class

            Decoder = decoder_class(loaded)  # one sentence for an architecture no family runs
            if loaded.family == CHAT:
                from engine.chat.reference import ChatReference

                reference = ChatReference(loaded)
            else:
                from engine.whisper.reference import WhisperReference

                reference = WhisperReference(loaded)
            key = source_key(loaded.source)
            precision, choice = self.precision, None
            if precision == "auto":
                from engine.precision import choose_precision

                choice = choose_precision(loaded, reference, lambda p, **kw: Decoder(loaded, precision=p, **kw), key)
                precision = choice.chosen
            # int8: a model's 4-bit layers kept so, unless auto timed them faster rounded to int8 here
            keep_4bit = choice.candidates[precision].get("keep_4bit", True) if choice is not None else True
            # Whisper int8: the encoder in float where auto found its integer products outside the word bound
            float_encoder = choice is not None and choice.candidates[precision].get("float_encoder", False)
            decoder = Decoder(loaded, precision=precision, keep_4bit=keep_4bit,
                              **({"float_encoder": True} if float_encoder else {}))
            # int8 chat: generated tokens on integer products where auto measured that and it qualified,
            # or, int8 asked for by name, on the 16-bit ones where they are faster here
            from engine.precision import INTEGER_WAYS, asked_int8_way, four_bit_products

            entry = choice.candidates.get(precision, {}) if choice is not None else {}
            if choice is None and precision == "int8":  # (counted once, for the status line)
                entry = {"four_bit": four_bit_products(decoder)}
                if loaded.family == CHAT and not os.environ.get("CADENCE_INT8_KERNEL"):  # (kernels named run as named)
                    entry.update(asked_int8_way(decoder, key))
            self._precisions[model] = (precision, choice, entry)
            integer = INTEGER_WAYS.get(entry.get("integer_way") or "")
            way = ""
            if entry.get("integer_dot") and integer and decoder.use_integer_dot(True, *integer):
                way = "-integer-" + entry["integer_way"].replace(" ", "-")  # its width calibration is its own
            if not keep_4bit:
                way += "-rounded-4-bit"
            if getattr(decoder, "encoder_int8", None):  # (its own calibration: the encoder's time differs)
                way += "-int8-encoder"
            asked = self.context if isinstance(self.context, int) and loaded.family == CHAT else None
            if asked:  # the width's memory bound is reckoned at the length asked for
                decoder.max_len = min(decoder.context_limit, asked)
            from engine.calibration import calibrate, slot_length

            calibration = None
            if self.batch == "auto" or self.drafter != "off":  # drafting needs the step-time curve too
                rule = lane_rule(loaded.family, self.width_rule) if self.batch == "auto" else "interactive"  # drafting: <= 16
                calibration = calibrate(decoder, loaded.source.name, f"{key}-{precision}{way}", rule=rule)
            if calibration is not None:
                self._calibrations[model] = calibration  # the curve and its choice, shown even when not used
            if self.batch == "auto":
                width = calibration.chosen
            else:
                width = 1 if self.batch == "off" else self.batch
            decoder.max_len, self._contexts[model] = slot_length(decoder, width, asked)
            drafter, planner, state = self._drafter(model, loaded, decoder, width, calibration)
            decoder.allocate(width)
            self._references[model] = reference
            self._lanes[model] = Lane(decoder, name=model, on_step=self._log_step, drafter=drafter, planner=planner,
                                      drafting_state=state)
            from engine.backend import return_freed_memory

            return_freed_memory()  # what choosing the precision and width made and dropped
        return self._lanes[model]

    def _drafter(self, model, loaded, decoder, width, calibration):
        """The lane's drafter, depth planner and drafting state ('on', 'off' or 'off: why')."""
        if self.drafter == "off":
            return None, None, "off"
        from engine.drafting import DepthPlanner, StepCost, build_drafter

        drafter, state = build_drafter(self.drafter, model, loaded, decoder, self.device, width, self.draft_min_p)
        if drafter is None:
            return None, None, state
        cost = StepCost(calibration.widths, calibration.step_ms, calibration.verify_ms)
        return drafter, DepthPlanner(cost, drafter, self.draft_depth), state

    def _calibrated_from(self, family: str) -> str:
        return "calibration" if (rule := lane_rule(family, self.width_rule)) == "interactive" else f"calibration, {rule} rule"

    def _log_step(self, record) -> None:
        if self._step_log is not None:
            self._step_log.write(json.dumps({"t": round(time.time(), 4), **record.to_json()}) + "\n")

    def status(self) -> dict:
        """The engine at a glance, for the app's panel and the CLI: backend, batching, each lane's
        width, calibration curve, cache memory, counters and what sits in which slot."""
        from engine.backend import describe_backend

        lanes = {}
        for model, lane in list(self._lanes.items()):
            calibration = self._calibrations.get(model)
            lanes[model] = {
                "family": lane.decoder.family,
                "architecture": lane.decoder.architecture,
                "width": lane.width,
                "width_from": self._calibrated_from(lane.decoder.family) if self.batch == "auto"
                else ("batch off" if self.batch == "off" else self.batch_source),
                **self._precision_status(model),
                "calibration": calibration.to_json() if calibration else None,
                "cache_bytes": lane.decoder.cache_bytes,
                "context": lane.decoder.max_len,  # positions per slot: prompt and answer together
                "context_limit": lane.decoder.context_limit,  # what the model itself handles
                "context_from": self._contexts.get(model, "the model"),
                "counters": lane.counters.to_json(),
                "slots": [None if s is None else {"request": getattr(s.handle, "id", None), "window": s.index,
                                                  "tokens": len(s.tokens), "context": s.fed,
                                                  "preparing": s.preparing is not None, "tok_s": _recent_rate(s.stamps),
                                                  "drafted": s.draft_counts.drafted, "accepted": s.draft_counts.accepted,
                                                  "acceptance": s.draft_counts.acceptance,
                                                  "depth": s.draft_counts.last_depth}
                          for s in list(lane.slots)],
                "waiting": len(lane.waiting),
                "held_for_live": bool(lane.slot_holders) and lane.width > 1,  # one slot kept free for recordings
                "drafting": {"drafter": lane.drafter.name if lane.drafter else self.drafter, "state": lane.drafting_state,
                             **lane.draft_counts.to_json(), "counts": lane.draft_counts.raw(),
                             **({"planner": lane.planner.report()} if lane.planner is not None else {})},
            }
        return {"backend": self.device, "backend_name": describe_backend(self.device), "batch": self.batch,
                "batch_from": self.batch_source, "drafter": self.drafter, "precision": self.precision,
                "context": self.context, "lanes": lanes}

    def _precision_status(self, model: str) -> dict:
        precision, choice, integer = self._precisions.get(model, (self.precision, None, {}))
        why = f"{precision}, as {'asked' if self.precision_source == 'argument' else self.precision_source}"
        if choice is None:  # int8 asked for by name: its 4-bit layers kept, which way generated tokens run, why
            from engine.precision import asked_int8_why

            kept = integer.get("four_bit")  # (counted when the lane was made)
            why += (f"; {kept} layer products on the model's own 4-bit weights" if kept else "") + asked_int8_why(integer)
        return {"precision": precision,
                "precision_from": "auto" if choice is not None else self.precision_source,
                "precision_why": choice.why if choice is not None else why,
                "precision_choice": choice.to_json() if choice is not None else None}

    def reference(self, model: str):
        """The model's reference decoder, whose prompt and token rules requests reuse."""
        return self._references[model]

    # engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        while True:
            busy = any(lane.busy for lane in self._lanes.values())
            if not self._take_commands(block=not busy):
                return
            busy_lanes = [lane for lane in self._lanes.values() if lane.busy]
            for lane in busy_lanes:
                try:
                    lane.step(shared=len(busy_lanes) > 1)
                except Exception as exc:  # a fault fails that lane's requests, not the engine
                    self._fail_lane(lane, exc)

    def _take_commands(self, block: bool) -> bool:
        """Handle the commands waiting between two steps (waiting for the first when idle): all of them, up
        to COMMAND_BUDGET_S, so requests that arrive together join the same step rather than one per step
        (64 clients of a server at once: the last had waited 63 steps, over 20 s, for its first token).
        False once told to stop."""
        deadline = None
        while True:
            try:
                command, handle = self._commands.get(block=block)
            except queue.Empty:
                return True
            if not self._command(command, handle):
                return False
            block = False
            deadline = deadline or time.perf_counter() + COMMAND_BUDGET_S
            if time.perf_counter() >= deadline:
                return True

    def _command(self, command, handle) -> bool:
        if command == "stop":
            for seqs in list(self._work.values()):
                if seqs:
                    seqs[0].handle.fail("The engine was shut down.")
            return False
        if command == "log":
            if self._step_log is not None:
                self._step_log.close()
            self._step_log = handle  # the new file, or None
        elif command == "submit":
            self._start(handle)
        elif command == "planned":
            self._planned(*handle)
        elif command == "call":  # work handed back to the engine thread (speakers told apart)
            handle()
        elif command == "live":  # a live recording's closed windows
            self._live_windows(*handle)
        elif command == "cancel":
            for seq in self._work.get(handle.id, []):
                seq.cancelled = True
        return True

    def _fail_lane(self, lane, exc: Exception) -> None:
        message = (f"The engine failed while decoding ({exc.__class__.__name__}: {exc}); "
                   f"details are in {record_fault(exc)}.")
        for seq in [s for s in lane.slots if s is not None] + list(lane.waiting):
            seq.cancelled = True
            if seq.handle is not None:
                seq.handle.fail(message)
        lane.slots = [None] * lane.width
        lane.waiting.clear()

    def _read_audio(self, handle: Handle, reference) -> None:
        """Reader thread: decode and plan a file's audio, then hand it back to the engine thread."""
        from engine.whisper.pipeline import read_plan

        try:
            result = read_plan(reference, handle.request)
            if result.samples is not None:
                from engine.speakers import diarize_plan

                result.speaker_turns = self._speakers.submit(diarize_plan, result)
        except Exception as exc:  # reported on the engine thread, as every start failure is
            result = exc
        self._commands.put(("planned", (handle, result)))

    def _planned(self, handle: Handle, plan) -> None:
        """Engine thread: a transcription's audio is read; its windows join the lane."""
        self._reading.pop(handle.id, None)
        if handle.ended:
            return
        if handle.cancelled:
            handle.fail(f"{plan.name if not isinstance(plan, Exception) else 'The file'}: transcription was cancelled.")
            return

        def start():
            if isinstance(plan, Exception):
                raise plan
            from engine.whisper.run import TranscriptionRun

            model = handle.request.model
            return TranscriptionRun(handle, self.lane(model, WHISPER), self.reference(model), plan,
                                    call_soon=lambda fn: self._commands.put(("call", fn))).start()

        self._begin(handle, start)

    def _start(self, handle: Handle) -> None:
        def start():
            request = handle.request
            if isinstance(request, ChatRequest):
                from engine.chat.run import ChatRun

                return ChatRun(handle, self.lane(request.model, CHAT), self.reference(request.model)).start()
            if isinstance(request, LiveTranscribeRequest):
                return self._start_live(handle)
            if isinstance(request, TranscribeRequest):
                self.lane(request.model, WHISPER)  # load the model here: its errors fail the request now
                self._reading[handle.id] = handle
                self._reader.submit(self._read_audio, handle, self.reference(request.model))
                return None
            raise CadenceError(f"Unknown request type {type(request).__name__}.")

        self._begin(handle, start)

    # live recordings ------------------------------------------------------------
    def _live_handle(self, request: LiveTranscribeRequest) -> LiveHandle:
        from engine.whisper.live import LiveAudio, LiveFeed

        if self._live_feed is None:
            self._live_feed = LiveFeed(self._commands.put)
        handle = LiveHandle(request, on_cancel=self.cancel, on_end=self._forget,
                            on_feed=lambda h, block, rate: self._live_feed.feed(h, h.audio, block, rate),
                            on_stop=lambda h: self._live_feed.stop(h, h.audio))
        handle.audio = LiveAudio()
        return handle

    def _start_live(self, handle: LiveHandle) -> list:
        """Engine thread: the recording's model and plan; its windows come as the recording closes them."""
        from engine.whisper.live import LiveRun
        from engine.whisper.pipeline import TranscriptionPlan, check_language

        request = handle.request
        try:
            lane, reference = self.lane(request.model, WHISPER), self.reference(request.model)
            language = check_language(reference.tok, reference.loaded.source.name, request.language, request.task)
            plan = TranscriptionPlan(request.name, language, [], 0.0, [], time.perf_counter(), set(), request.task,
                                     timestamps=request.timestamps, words=request.words)
            if language is not None:
                plan.set_prompt(reference.tok)
            handle.audio.n_mels = reference.model.config.num_mel_bins
            run = self._live_runs[handle.id] = LiveRun(handle, lane, reference, plan, handle.known)
            return run.start()
        finally:
            handle.audio.ready.set()  # the recording's audio is worked on from here (or dropped, on failure)

    def _live_windows(self, handle: LiveHandle, windows, final: bool) -> None:
        run = self._live_runs.get(handle.id)
        if run is None or handle.ended:
            return
        if isinstance(windows, Exception):
            handle.fail(f"The live transcription stopped ({windows.__class__.__name__}: {windows}); details are in "
                        f"{record_fault(windows)}.")
            return
        try:
            run.add_windows(windows, final)
        except CadenceError as exc:
            handle.fail(str(exc))

    def _begin(self, handle: Handle, start: Callable[[], list | None]) -> None:
        """Run a request's start on the engine thread; any failure becomes its one-sentence event."""
        try:
            seqs = start()
            if seqs is not None and not handle.ended:  # (one whose windows were all done earlier has ended)
                self._work[handle.id] = seqs
        except CadenceError as exc:
            handle.fail(str(exc))
        except Exception as exc:
            handle.fail(f"The request could not start ({exc.__class__.__name__}: {exc}); "
                        f"details are in {record_fault(exc)}.")


__all__ = ["Engine"]
