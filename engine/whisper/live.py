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
from engine.whisper.pipeline import SILENCE_RMS, TranscriptionPlan, _rms, result_segments, window_key
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
    """A live recording's windows on the lane, served before queued files' (urgent sequences); each
    decoded window is kept by its key for the saved file's transcription to reuse."""

    urgent = True

    def __init__(self, handle: Handle, lane, reference, plan: TranscriptionPlan, known: dict):
        super().__init__(handle, lane, reference, plan)
        self.known = known
        self.stopped = False
        self.starts: dict[int, int] = {}  # first frame -> the window index shown for it
        self.latest: dict[int, int] = {}  # first frame -> the plan index of its latest (largest) decoding
        self.superseded: set[int] = set()  # plan indices whose window grew before their decoding started

    def start(self) -> list:
        plan, handle = self.plan, self.handle
        self.lane.hold_slot(self)  # released when the run ends (engine.engine forgets it)
        handle.emit(TranscriptionStarted(handle.id, language=plan.language, window_times=[], done=0, total=0))
        return self.seqs

    def add_windows(self, windows, final: bool) -> None:
        """Windows closed by the recording so far (see LiveAudio.update)."""
        for seek, size, features, silent in windows:
            index = len(self.plan.spans)
            self.plan.spans.append((seek, size, features))
            self.plan.duration = max(self.plan.duration, (seek + size) / FRAMES_PER_SECOND)
            earlier = self.latest.get(seek)
            self.latest[seek] = index
            if earlier is not None and earlier not in self.results:
                self._supersede(earlier)
            if silent:
                self.results[index] = self.plan.silent_result()
                continue
            if self.plan.language is None:
                from engine.whisper.pipeline import detect_plan_language

                self.plan.detect_window = features
                detect_plan_language(self.ref, self.plan)
            self._add(index, features, size)
        if final:
            self.stopped = True
            self._finish_if_complete()

    def _supersede(self, index: int) -> None:
        """The window of decoding ``index`` grew. A decoding still waiting for a slot is dropped (the larger
        one replaces it); one already in a slot finishes, so its captions show meanwhile."""
        pending = [seq for seq in self.seqs if seq.index == index and seq.finish_reason is None]
        if pending and all(seq.slot < 0 for seq in pending) and index not in self.decoding:
            self.superseded.add(index)
            for seq in pending:
                seq.cancelled = True

    def _on_finish(self, seq) -> None:
        if seq.index in self.superseded:  # not an error: a larger decoding of its window replaces it
            self.results.setdefault(seq.index, self.plan.silent_result())
            self.decoding.pop(seq.index, None)
            self._finish_if_complete()
            return
        super()._on_finish(seq)

    def _report(self, index: int, window, earlier: bool = False) -> None:
        """A window's captions, as ``progress`` whose ``index`` is the same for every decoding of a window
        that grew (so a view replaces the earlier text); the result kept for the saved file's run."""
        self.known[window_key(self.plan, index)] = window
        shown = self.starts.setdefault(self.plan.spans[index][0], len(self.starts))
        segments = result_segments(self.plan, self.ref.tok, index, window)
        self.handle.emit(Progress(self.handle.id, index=shown, done=len(self.results), total=len(self.plan.spans),
                                  window=window, text=" ".join(s.text for s in segments), segments=segments))

    def _finish_if_complete(self) -> None:
        if self.stopped:
            super()._finish_if_complete()


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

