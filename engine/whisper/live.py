"""Live captions: a recording transcribed window by window while it is being made.

:class:`LiveAudio` (on the engine's live thread) takes the recorder's blocks as the file holds them
(16-bit samples, channels averaged), resamples them as a stream exactly as reading the finished
file does, and keeps the voice activity and the log-mel frames up to date as the audio grows: every
frame and every voice probability depends only on the audio before it (the detector's blocks are
cut where the whole-file pass cuts them), so they equal the finished file's. Whenever a window of
speech is closed by a pause (or reaches 30 s), its features go to the engine, where
:class:`LiveRun` decodes it in a slot of the model's lane ahead of queued files, and its text comes
back as a ``progress`` event. A window that grows later (speech resumed within its 30 s) is decoded
again at its new size.

After Stop, the saved file is transcribed as any file is (so the final transcript is exactly what
transcribing the file gives); every window decoded live whose span, prompt and features turn out
identical is taken as it is (``TranscribeRequest.known_windows``), so only the others are decoded.
"""

from __future__ import annotations

import threading

import numpy as np

from engine.api import Handle, Progress, TranscriptionStarted
from engine.audio import SAMPLE_RATE, _Collector
from engine.whisper.features import FRAMES_PER_SECOND, HOP_LENGTH, N_FFT, log_mel_frames, normalize, pad_window
from engine.whisper.pipeline import (
    FOLLOW_UP_MIN_S,
    SILENCE_RMS,
    TranscriptionPlan,
    WindowDecoding,
    _rms,
    left_out,
    result_segments,
    steps_to_frames,
    window_key,
)
from engine.whisper.run import TranscriptionRun
from engine.whisper.vad import CHUNK, CONTEXT, detector, vad_windows

UPDATE_S = 0.5  # new windows are looked for after this much new audio
HOLD_S = 0.3  # a window ending this close to the audio received so far may still grow: not decoded yet


def file_samples(block: np.ndarray) -> np.ndarray:
    """A recorder block [frames, channels] as the 16-bit file holds it, channels averaged as reading it does."""
    quantized = np.round(np.clip(np.asarray(block, np.float32) * 32768.0, -32768, 32767)) / np.float32(32768.0)
    quantized = quantized.astype(np.float32).reshape(len(block), -1)
    return quantized[:, 0] if quantized.shape[1] == 1 else quantized.mean(axis=1, dtype=np.float32)


class LiveAudio:
    """A recording's 16-kHz audio, voice activity and log-mel frames, kept up to date as it grows."""

    def __init__(self):
        self.collector = _Collector("recording")
        self.n_mels: int | None = None  # set once the model is known ...
        self.ready = threading.Event()  # ... (or it failed to load), on the engine thread
        self.probabilities: list[np.ndarray] = []  # voice activity per chunk so far
        self.vad_chunks = 0
        self.vad_state = None
        self.spectrum: np.ndarray | None = None  # log10 mel power [n_mels, room], the first ``frames`` filled
        self.frames = 0
        self.top = -np.inf  # the loudest log-mel value so far
        self.since_update = 0
        self.sent: set[tuple[int, int]] = set()  # (first frame, frames) of windows already sent

    @property
    def samples(self) -> np.ndarray:
        return self.collector.buf[: self.collector.size]

    def add(self, block: np.ndarray, rate: int) -> None:
        before = self.collector.size
        self.collector.add(file_samples(block), rate)
        self.since_update += self.collector.size - before

    @property
    def due(self) -> bool:
        return self.since_update >= UPDATE_S * SAMPLE_RATE

    def _voice(self, final: bool) -> np.ndarray:
        """Voice probabilities of the audio so far, each whole chunk once, the detector's state carried on
        (its probabilities are then those of the whole-file pass, bit for bit)."""
        samples = self.samples
        total = -(-samples.size // CHUNK) if final else samples.size // CHUNK  # at the end, the tail padded
        done = self.vad_chunks
        if total > done:
            vad = detector()
            audio = samples[done * CHUNK : total * CHUNK]
            chunks = np.pad(audio, (0, (total - done) * CHUNK - audio.size)).reshape(-1, CHUNK)
            before = samples[max(0, done * CHUNK - CONTEXT) : done * CHUNK]  # the chunk before (zeros at first)
            context = np.concatenate([np.pad(before, (CONTEXT - before.size, 0))[None], chunks[:-1, -CONTEXT:]])
            probs, self.vad_state = vad.block(chunks, context, self.vad_state or vad.initial_state())
            self.probabilities.append(probs)
            self.vad_chunks = total
        if len(self.probabilities) > 1:
            self.probabilities = [np.concatenate(self.probabilities)]
        return self.probabilities[0] if self.probabilities else np.zeros(0, np.float32)

    def _spectrum(self) -> None:
        """Log-mel frames whose samples have all arrived (the first ones reflected at the start, as the
        whole file's are), appended to ``self.spectrum``."""
        samples = self.samples
        half = N_FFT // 2
        if samples.size <= half:
            return
        available = (samples.size + half - N_FFT) // HOP_LENGTH + 1  # padded in front only
        if available <= self.frames:
            return
        lo, hi = self.frames * HOP_LENGTH, (available - 1) * HOP_LENGTH + N_FFT  # in the padded signal
        if lo >= half:
            piece = samples[lo - half : hi - half]
        else:
            piece = np.concatenate([samples[half:0:-1][lo:], samples[: hi - half]])
        frames = log_mel_frames(piece, 0, available - self.frames, self.n_mels)
        if self.spectrum.shape[1] < available:
            grown = np.empty((self.n_mels, max(available, self.spectrum.shape[1] * 3 // 2)), np.float32)
            grown[:, : self.frames] = self.spectrum[:, : self.frames]
            self.spectrum = grown
        self.spectrum[:, self.frames : available] = frames
        self.top = max(self.top, float(frames.max()))
        self.frames = available

    def update(self, final: bool = False) -> list[tuple[int, int, np.ndarray, bool]]:
        """Windows closed since the last call: (first frame, frames, padded features, silent)."""
        self.since_update = 0
        self.ready.wait()  # blocks queue up meanwhile: the model is loading
        if self.n_mels is None or self.samples.size < SAMPLE_RATE // 10:
            return []
        if self.spectrum is None:
            self.spectrum = np.empty((self.n_mels, 0), np.float32)
        probabilities = self._voice(final)
        self._spectrum()
        if self.frames == 0:
            return []
        spectrum = self.spectrum
        samples = self.samples
        hold = 0 if final else int(HOLD_S * FRAMES_PER_SECOND)
        out = []
        for seek, size in vad_windows(probabilities, samples.size):
            size = min(size, self.frames - seek)
            if size <= 0 or (seek, size) in self.sent or (seek + size) * HOP_LENGTH > samples.size - hold * HOP_LENGTH:
                continue
            self.sent.add((seek, size))
            features = pad_window(normalize(spectrum[:, seek : seek + size], self.top))
            silent = _rms(samples[seek * HOP_LENGTH : (seek + size) * HOP_LENGTH]) < SILENCE_RMS
            out.append((seek, size, features, silent))
        return out


class LiveRun(TranscriptionRun):
    """A live recording's windows on the lane, served before queued files' (urgent sequences).

    A window grows while speech goes on within its 30 s. With timestamps, its new speech is then decoded
    on its own, from where the earlier decoding's last phrase ended, and joined on (as a follow-up part
    is): the caption comes after a decoding of a few seconds of speech rather than of the whole window
    again. Such a joined result is provisional: it is shown, but only whole-window decodings are kept
    for the saved file's transcription (``known``), and after Stop every window whose latest caption is
    provisional is decoded whole, so the file's transcription can reuse it."""

    urgent = True

    def __init__(self, handle: Handle, lane, reference, plan: TranscriptionPlan, known: dict):
        super().__init__(handle, lane, reference, plan)
        self.known = known
        self.stopped = False
        self.starts: dict[int, int] = {}  # first frame -> the window index shown for it
        self.latest: dict[int, int] = {}  # first frame -> the plan index of its latest (largest) decoding
        self.superseded: set[int] = set()  # plan indices whose window grew before their decoding started
        self.shown: dict[int, int] = {}  # first frame -> the plan index of its latest caption (a finished decoding)
        self.deferred: dict[int, int] = {}  # first frame -> a grown window's plan index, waiting for the decoding before
        self.provisional: set[int] = set()  # plan indices decoded as new speech joined onto an earlier caption

    def start(self) -> list:
        plan, handle = self.plan, self.handle
        self.lane.hold_slot(self)  # released when the run ends (engine.engine forgets it)
        handle.emit(TranscriptionStarted(handle.id, language=plan.language, window_times=[], done=0, total=0))
        return self.seqs

    def add_windows(self, windows, final: bool) -> None:
        """Windows closed by the recording so far (see LiveAudio.update)."""
        for seek, size, features, silent in windows:
            index = self._new_span(seek, size, features)
            earlier = self.latest.get(seek)
            self.latest[seek] = index
            if silent:
                self._drop_waiting(earlier, seek)
                self.results[index] = self.plan.silent_result()
                continue
            if self.plan.language is None:
                from engine.whisper.pipeline import detect_plan_language

                self.plan.detect_window = features
                detect_plan_language(self.ref, self.plan)
            if not self._drop_waiting(earlier, seek) and self.rules is not None:
                self._defer(seek, index)  # the decoding before is in a slot: this one starts from its end
            else:
                self._decode(seek, index)
        if final:
            self.stopped = True
            self._finish_if_complete()

    def _new_span(self, seek: int, size: int, features: np.ndarray) -> int:
        self.plan.spans.append((seek, size, features))
        self.plan.duration = max(self.plan.duration, (seek + size) / FRAMES_PER_SECOND)
        return len(self.plan.spans) - 1

    def _drop_waiting(self, index: int | None, seek: int) -> bool:
        """Drop decoding ``index`` (of the window at ``seek``, which grew) if none of it has started: the
        larger one replaces it. True when nothing of the window is decoding any more (False: a decoding is
        in a slot, and the larger one is to start from its end)."""
        if index is None or index in self.results:
            return True
        if self.deferred.get(seek) == index:  # never started: it waited for the decoding before it, still in a slot
            del self.deferred[seek]
            self._superseded(index)
            return False
        mine = [seq for seq in self.seqs if seq.index == index]
        if any(seq.finish_reason is not None or seq.slot >= 0 for seq in mine):
            return False  # in a slot, or a part of it done: it finishes, so its captions show meanwhile
        self.superseded.add(index)
        for seq in mine:
            seq.cancelled = True
        return True

    def _superseded(self, index: int) -> None:
        self.superseded.add(index)
        self.results[index] = self.plan.silent_result()  # not shown: a larger decoding of its window replaces it

    def _defer(self, seek: int, index: int) -> None:
        self.deferred[seek] = index

    def _decode(self, seek: int, index: int) -> None:
        """Decode window ``index``: its new speech alone, joined onto the window's latest caption where
        that ended on a time, else the whole window."""
        base = self.results.get(self.shown[seek]) if seek in self.shown else None
        _, size, features = self.plan.spans[index]
        steps = self._resume_steps(base)
        if steps is not None and (size - steps_to_frames(steps)) / FRAMES_PER_SECOND >= FOLLOW_UP_MIN_S:
            frames = steps_to_frames(steps)
            self.decoding[index] = WindowDecoding(base, list(base.tokens), steps=steps,
                                                  words=list(base.words) if base.words is not None else None)
            self.provisional.add(index)
            self._add(index, pad_window(features[:, frames:size]), size - frames)
        else:
            self._add(index, features, size)

    def _resume_steps(self, base) -> int | None:
        """Where the new speech is decoded from, in time steps from the window's start: where ``base``'s last
        phrase ended (or its next one began). None: decode the whole window (no timestamps, no caption yet,
        or one the transcript leaves out)."""
        if self.rules is None or base is None or not base.tokens or left_out(base):
            return None
        last = base.tokens[-1]
        return last - self.rules.begin if last >= self.rules.begin else None

    def _on_finish(self, seq) -> None:
        if seq.index in self.superseded:  # not an error: a larger decoding of its window replaces it
            self.results.setdefault(seq.index, self.plan.silent_result())
            self.decoding.pop(seq.index, None)
            self._finish_if_complete()
            return
        super()._on_finish(seq)

    def _report(self, index: int, window, earlier: bool = False) -> None:
        """A window's captions, as ``progress`` whose ``index`` is the same for every decoding of a window
        that grew (so a view replaces the earlier text); a whole-window result is kept for the saved file's
        run. A grown window waiting for this decoding starts now, from its end."""
        seek = self.plan.spans[index][0]
        if index not in self.provisional:
            self.known[window_key(self.plan, index)] = window
        if self.shown.get(seek, -1) < index:  # (else a larger decoding of the window is shown already)
            self.shown[seek] = index
            shown = self.starts.setdefault(seek, len(self.starts))
            segments = result_segments(self.plan, self.ref.tok, index, window)
            self.handle.emit(Progress(self.handle.id, index=shown, done=len(self.results), total=len(self.plan.spans),
                                      window=window, text=" ".join(s.text for s in segments), segments=segments,
                                      provisional=index in self.provisional))
        waiting = self.deferred.pop(seek, None)
        if waiting is not None:
            self._decode(seek, waiting)

    def _finish_if_complete(self) -> None:
        if not self.stopped or len(self.results) < len(self.plan.spans):
            return
        for seek, index in self.latest.items():  # after Stop: provisional captions decoded whole, for reuse
            if index in self.provisional:
                whole = self._new_span(*self.plan.spans[index])
                self.latest[seek] = whole
                self._add(whole, self.plan.spans[whole][2], self.plan.spans[whole][1])
        if len(self.results) == len(self.plan.spans):
            super()._finish_if_complete()

    def _final_windows(self) -> list[int]:
        """The latest decoding of each window, in time order (earlier and superseded ones were captions only)."""
        return sorted(self.latest.values(), key=lambda index: self.plan.spans[index][0])


class LiveFeed:
    """The engine's side of live recordings: their audio is taken on one thread of its own (so neither
    decoding nor the recorder waits), and closed windows are handed to the engine thread."""

    def __init__(self, post):
        from concurrent.futures import ThreadPoolExecutor

        self.post = post  # puts a command on the engine thread's queue
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadence-live")

    def feed(self, handle, audio: LiveAudio, block: np.ndarray, rate: int) -> None:
        self.pool.submit(self._add, handle, audio, np.array(block, np.float32, copy=True), rate)

    def stop(self, handle, audio: LiveAudio) -> None:
        self.pool.submit(self._update, handle, audio, True)

    def _add(self, handle, audio: LiveAudio, block: np.ndarray, rate: int) -> None:
        audio.add(block, rate)
        if audio.due:
            self._update(handle, audio, False)

    def _update(self, handle, audio: LiveAudio, final: bool) -> None:
        try:
            if final:
                audio.collector._flush()
            windows = audio.update(final)
        except Exception as exc:  # reported on the engine thread
            self.post(("live", (handle, exc, True)))
            return
        if windows or final:
            self.post(("live", (handle, windows, final)))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

