"""One transcription on the batched engine: a sequence per window on the model's lane, events out.

Runs on the engine thread once the reader thread has planned the file (:func:`engine.whisper.pipeline.read_plan`).
The rules (prompt, suppression, time tokens, follow-up parts, loop cuts, silent windows) are the
pipeline's, shared with the reference decoder, so the engine's tokens are held to the same ones.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from engine.api import Finished, Handle, Progress, TranscriptionStarted
from engine.drafting import DraftCounts
from engine.errors import CadenceError, record_fault
from engine.scheduler import Sequence
from engine.whisper.window import WindowState
from engine.whisper.pipeline import (
    LOOP_MIN_TOKENS,
    TranscriptionPlan,
    WindowDecoding,
    assemble_transcript,
    detect_plan_language,
    part_alignment_prompt,
    part_text,
    part_words,
    repetition_start,
    result_segments,
    steps_to_frames,
    window_key,
)
from engine.transcript import WindowResult
from engine.whisper.reference import WhisperReference
from engine.whisper.timestamps import TimestampRules


class TranscriptionRun:
    """A planned file's windows on ``lane`` (whose decoder is Whisper's), ``reference`` giving the rules."""

    urgent = False  # its sequences join before others (a live recording's, see engine.whisper.live)

    def __init__(self, handle: Handle, lane, reference: WhisperReference, plan: TranscriptionPlan,
                 call_soon: Callable[[Callable[[], None]], None] | None = None):
        """``call_soon`` runs a function on the engine thread later (once the speakers are told apart)."""
        self.handle, self.lane, self.ref, self.plan = handle, lane, reference, plan
        self.call_soon = call_soon
        self.waiting_for_speakers = False
        self.rules = TimestampRules.of(reference.tok) if plan.timestamps else None
        self.results: dict[int, WindowResult] = {}
        self.drafting = DraftCounts()  # this file's windows' drafts, for its stats
        self.features: dict[Sequence, np.ndarray] = {}  # what each sequence decodes: a window, or the rest of one
        self.decoding: dict[int, WindowDecoding] = {}  # windows with a follow-up part still to decode
        self.seqs: list[Sequence] = []
        self.reused = 0  # windows taken from the request's known windows
        self.aligned_text: dict[Sequence, tuple[list[int], list[float]]] = {}  # a part's text, while aligned

    def start(self) -> list[Sequence]:
        plan, req, handle = self.plan, self.handle.request, self.handle
        if plan.words:
            from engine.whisper.alignment import require_heads

            self.lane.decoder.set_alignment_heads(require_heads(self.ref.loaded))
        if plan.language is None and plan.has_speech:
            detect_plan_language(self.ref, plan)
        self.results = {i: plan.silent_result() for i in plan.silent}
        still_valid = req.on_plan(plan) if req.on_plan else True  # False: the earlier windows lay elsewhere
        done = (req.done_windows or {}) if still_valid is not False else {}
        earlier = {i: r for i, r in done.items() if 0 <= i < len(plan.spans)}
        self.results.update(earlier)
        known = req.known_windows or {}
        for index in range(len(plan.spans)) if known else ():  # decoded before, on the same features
            if index not in self.results and (result := known.get(window_key(plan, index))) is not None:
                self.results[index] = earlier[index] = result
                self.reused += 1
                if req.on_window:
                    req.on_window(index, result)
        handle.emit(TranscriptionStarted(handle.id, language=plan.language, window_times=plan.window_times(),
                                         done=len(self.results), total=len(plan.spans)))
        for index in sorted(earlier):  # a resumed job's windows, so a live view does not start empty
            self._report(index, earlier[index], earlier=True)
        for index, (_, size, window) in enumerate(plan.spans):
            if index not in self.results:
                self._add(index, window, size)
        self._finish_if_complete()  # every window was done in an earlier run
        return self.seqs

    # ------------------------------------------------------------------ sequences
    def _add(self, index: int, window: np.ndarray, size: int) -> None:
        """A sequence decoding ``window`` (a window, or the rest of one) for window ``index``; ``size``:
        frames of content, for the joining order."""
        ref, plan = self.ref, self.plan
        decoder = self.lane.decoder
        seq = Sequence(list(plan.prompt), decoder.max_len - len(plan.prompt), {ref.tok.eot},
                       suppress=ref.suppress, begin_suppress=ref.begin_suppress,
                       rules=self.rules and self.rules.apply, prepare=self._prepare, on_token=self._on_token,
                       on_finish=self._on_finish, handle=self.handle, index=index, size=size,
                       window=WindowState(probe_row=plan.prompt.index(ref.tok.sot),
                                          token_probs=[] if plan.words else None),
                       follow_on=self._align if plan.words else None, urgent=self.urgent)
        self.features[seq] = window
        self.lane.add(seq)
        self.seqs.append(seq)

    def _prepare(self, seq: Sequence, slot: int):
        """On joining a slot: encode the window into the slot's cross-attention memory, as a generator the
        lane advances a layer at a time, as it finds room (see Lane._prepare)."""
        decoder = self.lane.decoder
        window = torch.from_numpy(self.features.pop(seq))[None].to(decoder.device, decoder.dtype)
        encoded = yield from decoder.encode_in_steps(window)
        decoder.set_memory(slot, encoded[0])

    def _on_token(self, seq: Sequence, token: int) -> bool:
        """True stops a window that has fallen into a repetition loop."""
        text = self.rules.text_only(seq.tokens) if self.rules else seq.tokens
        return len(text) >= LOOP_MIN_TOKENS and repetition_start(text) is not None

    def _align(self, seq: Sequence, reason: str) -> bool:
        """A part is decoded: read its text again in the same slot (its encoder memory is still there),
        collecting the alignment heads' attention (see engine.whisper.alignment). False: no text to time."""
        text, probs = part_text(self.rules, seq.tokens, seq.window.token_probs)
        if not text:
            return False
        self.aligned_text[seq] = (text, probs)
        seq.prompt, seq.fed = part_alignment_prompt(self.ref.tok, self.plan, text), 0
        seq.window.aligning = True
        return True

    def _on_finish(self, seq: Sequence) -> None:
        handle, plan = self.handle, self.plan
        if handle.ended:  # the request already failed or was cancelled
            return
        if seq.finish_reason == "cancelled":
            handle.fail(f"{plan.name}: transcription was cancelled.")
            return
        self.drafting.merge(seq.draft_counts)
        window_decoding = self.decoding.pop(seq.index, None)
        if window_decoding is None:  # the window's first part
            state = seq.window
            head = WindowResult(seq.tokens, self.ref.no_speech_probability(state.probe_logits),
                                state.logprob_sum / (len(seq.tokens) + 1))
            window_decoding = WindowDecoding(head, seq.tokens)
        else:  # the rest of a window, decoded after its earlier parts
            window_decoding.join(self.rules, seq.tokens)
        if seq in self.aligned_text:
            text, probs = self.aligned_text.pop(seq)
            scores = torch.cat(seq.window.attention, dim=1).numpy()
            seq.window.attention = []
            window_decoding.add_words(part_words(self.ref.tok, plan, text, scores, seq.index, window_decoding.steps,
                                                 probs))
        elif plan.words:
            window_decoding.add_words([])
        rest = window_decoding.rest(plan, self.rules, seq.index, seq.tokens)
        if rest is not None:  # the model left the rest of the window: decode it as a part of its own
            self.decoding[seq.index] = window_decoding
            self._add(seq.index, rest, plan.spans[seq.index][1] - steps_to_frames(window_decoding.steps))
            return
        window = window_decoding.result()
        self.results[seq.index] = window
        if handle.request.on_window:
            try:  # the caller's record of a window (the job store) failing ends this file, not the lane
                handle.request.on_window(seq.index, window)
            except Exception as exc:
                for other in self.seqs:
                    other.cancelled = True
                handle.fail(f"{plan.name}: its progress could not be recorded ({exc.__class__.__name__}: {exc}); "
                            f"details are in {record_fault(exc)}.")
                return
        self._report(seq.index, window)
        self._finish_if_complete()

    # ------------------------------------------------------------------ events
    def _report(self, index: int, window: WindowResult, earlier: bool = False) -> None:
        segments = result_segments(self.plan, self.ref.tok, index, window)
        self.handle.emit(Progress(self.handle.id, index=index, done=len(self.results), total=len(self.plan.spans),
                                  window=window, text=" ".join(s.text for s in segments), segments=segments,
                                  earlier=earlier))

    def _final_windows(self) -> list[int]:
        """The plan indices of the windows the transcript is made of, in order."""
        return list(range(len(self.plan.spans)))

    def _finish_if_complete(self) -> None:
        plan, handle = self.plan, self.handle
        if len(self.results) < len(plan.spans) or handle.ended:
            return
        turns = plan.speaker_turns
        if turns is not None and not turns.done() and self.call_soon is not None:  # the speakers come later
            if not self.waiting_for_speakers:
                self.waiting_for_speakers = True
                turns.add_done_callback(lambda _: self.call_soon(self._finish_if_complete))
            return
        kept = self._final_windows()
        if len(kept) < len(plan.spans):
            plan = dataclasses.replace(plan, spans=[plan.spans[i] for i in kept])
        transcript = assemble_transcript(plan, self.ref.tok, [self.results[i] for i in kept])
        transcript.stats["drafting"] = self.drafting.to_json()
        if self.reused:
            transcript.stats["reused_windows"] = self.reused
        if turns is not None:
            from engine.speakers import label_segments

            try:
                label_segments(transcript.segments, turns.result())
            except CadenceError as exc:
                handle.fail(f"{plan.name}: {exc}")
                return
            except Exception as exc:
                handle.fail(f"{plan.name}: speakers could not be told apart ({exc.__class__.__name__}: {exc}); "
                            f"details are in {record_fault(exc)}.")
                return
            transcript.stats["speakers"] = len({s.speaker for s in transcript.segments if s.speaker})
        handle.emit(Finished(handle.id, transcript=transcript))
