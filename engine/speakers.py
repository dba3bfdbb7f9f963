"""Who spoke when: voice embeddings of the speech, clustered into speakers, turned into speaker turns.

The voice encoder is Resemblyzer's (a 3-layer LSTM over 40-band mel spectrograms, trained for
speaker verification; Apache-2.0; its weights ship inside the ``resemblyzer`` package and are read
with ``torch.load(weights_only=True)`` without importing the package, whose audio code needs other
libraries). Every stretch of speech the voice activity detector finds is cut into side-by-side 1.6-s
pieces; each piece gets a 256-number voice print; the prints are grouped by agglomerative
clustering (Ward's linkage on the unit vectors, scikit-learn) into the number of speakers asked
for, or, with "auto", into as many as keep every two groups' mean voice prints clearly apart
(cosine similarity below 0.8: splitting one voice in two gives groups above it), each with a few
seconds of speech. Each 10-ms frame of speech takes the speaker of the pieces over it; runs of one
speaker are the turns. It runs on a thread of its own beside decoding (see engine.engine), never in
a step, with the LSTM on one thread of its own, so it does not compete for the decoder's threads.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.api import auto_off_or_number
from engine.audio import SAMPLE_RATE
from engine.errors import CadenceError, RequestError

MAX_SPEAKERS = 20
PIECE_FRAMES = 160  # 1.6 s of 10-ms frames: what the encoder was trained on
PIECE_STEP = 160  # a piece every 1.6 s, side by side (overlapping them by half cost 1.5 times as much)
PRINT_BATCH = 64  # pieces through the encoder at once
MIN_PIECE_FRAMES = 50  # a stretch of speech shorter than 0.5 s gets no voice print of its own
TARGET_DBFS = -30.0  # each stretch brought to this loudness first (the encoder's training level)
SAME_SPEAKER_SIMILARITY = 0.8  # two groups whose mean voice prints are this alike are one speaker
MAX_AUTO_SPEAKERS = 8
MIN_SPEAKER_PIECES = 3  # with "auto", a group of fewer pieces (under about 2.5 s of speech) is not a speaker
HOP = 160
N_FFT = 400


@dataclass(frozen=True)
class Turn:
    start: float
    end: float
    speaker: str  # "S1", "S2", ... in order of first appearance


def parse_speakers(value) -> str | int:
    """'auto', 'off' or a number of speakers from 1 to MAX_SPEAKERS; anything else gets a sentence."""
    n = auto_off_or_number(value, "Speakers must be auto, off or a number of speakers (got '{value}').")
    if isinstance(n, str):
        return n
    if not 1 <= n <= MAX_SPEAKERS:
        raise RequestError(f"The number of speakers must be from 1 to {MAX_SPEAKERS} (got {n}).")
    return n


# ---------------------------------------------------------------------------- the voice encoder
def weights_path() -> Path:
    spec = importlib.util.find_spec("resemblyzer")
    if spec is None or not spec.submodule_search_locations:
        raise CadenceError("Telling speakers apart needs the resemblyzer package (run `make setup`).")
    path = Path(list(spec.submodule_search_locations)[0]) / "pretrained.pt"
    if not path.is_file():
        raise CadenceError("The resemblyzer package has no pretrained.pt; reinstall it with `make setup`.")
    return path


class VoiceEncoder:
    """Resemblyzer's speaker encoder: [pieces, frames, 40] mel power -> [pieces, 256] unit voice prints.

    It works beside the engine's decoding, on one core: PyTorch's LSTM, with OpenMP held to one thread
    for the calling thread only (the decoder's threads keep theirs; sharing them would oversubscribe
    the cores). In bfloat16 where this processor runs it faster than float32 (timed once, at load:
    with bfloat16 instructions about 2.5 times faster; voice prints within 0.001 of float32's cosine),
    else float32."""

    def __init__(self):
        import torch

        state = torch.load(weights_path(), map_location="cpu", weights_only=True)["model_state"]
        self.lstm = torch.nn.LSTM(40, 256, 3, batch_first=True)
        self.lstm.load_state_dict({k[len("lstm."):]: v for k, v in state.items() if k.startswith("lstm.")})
        self.linear = torch.nn.Linear(256, 256)
        self.linear.load_state_dict({k[len("linear."):]: v for k, v in state.items() if k.startswith("linear.")})
        self.copies = {torch.float32: (self.lstm, self.linear)}  # the weights in each dtype tried
        self.dtype = self._faster_dtype()

    def _faster_dtype(self):
        import torch

        probe = np.random.default_rng(0).random((PRINT_BATCH, PIECE_FRAMES, 40), dtype=np.float32)
        timed = {}
        for dtype in (torch.float32, torch.bfloat16):
            try:
                self._run(probe, dtype)  # the first call sets up the kernels
                start = time.perf_counter()
                self._run(probe, dtype)
                timed[dtype] = time.perf_counter() - start
            except RuntimeError:  # a build without bfloat16 LSTM kernels
                pass
        return min(timed, key=timed.get)

    def _run(self, mels: np.ndarray, dtype) -> np.ndarray:
        import torch
        from threadpoolctl import threadpool_limits

        torch.ones(1 << 16).sum()  # PyTorch sets this thread's thread count on its first parallel work: first
        with threadpool_limits(limits=1, user_api="openmp"), torch.inference_mode():  # then one thread, here only
            if dtype not in self.copies:
                self.copies[dtype] = (copy.deepcopy(self.lstm).to(dtype), copy.deepcopy(self.linear).to(dtype))
            lstm, linear = self.copies[dtype]
            x = torch.from_numpy(np.ascontiguousarray(mels, dtype=np.float32)).to(dtype)
            _, (hidden, _) = lstm(x)
            raw = torch.relu(linear(hidden[-1])).float()
            return (raw / raw.norm(dim=1, keepdim=True).clamp_min(1e-12)).numpy()

    def __call__(self, mels: np.ndarray) -> np.ndarray:
        return self._run(mels, self.dtype)


_ENCODER: VoiceEncoder | None = None


def encoder() -> VoiceEncoder:
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = VoiceEncoder()
    return _ENCODER


def voice_mel(samples: np.ndarray) -> np.ndarray:
    """[frames, 40] mel power spectrogram (25-ms Hann windows every 10 ms, zero-padded at the edges),
    the encoder's input; not a log spectrogram."""
    from engine.whisper.features import mel_filters

    audio = np.pad(samples.astype(np.float32), (N_FFT // 2, N_FFT // 2))
    n = 1 + (audio.size - N_FFT) // HOP
    frames = np.lib.stride_tricks.as_strided(audio, (n, N_FFT), (HOP * audio.strides[0], audio.strides[0]))
    window = np.hanning(N_FFT + 1)[:-1].astype(np.float32)
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    return (power @ mel_filters(40).T).astype(np.float32)


def _loudness_normalized(x: np.ndarray) -> np.ndarray:
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0
    return x * (10 ** (TARGET_DBFS / 20) / rms) if rms > 1e-6 else x


# ---------------------------------------------------------------------------- pieces, prints, speakers
def speech_pieces(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first frame, frames) of the pieces voice prints are taken from, within speech regions (the last
    piece of a region ends at its end, overlapping the one before)."""
    pieces = []
    for start, end in regions:
        first, last = start // HOP, end // HOP
        if last - first < MIN_PIECE_FRAMES:
            continue
        if last - first <= PIECE_FRAMES:
            pieces.append((first, last - first))
            continue
        at = first
        while at + PIECE_FRAMES < last:
            pieces.append((at, PIECE_FRAMES))
            at += PIECE_STEP
        pieces.append((last - PIECE_FRAMES, PIECE_FRAMES))
    return pieces


def voice_prints(samples: np.ndarray, regions: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The pieces (first frame, frames) and their voice prints [pieces, 256]; each region's loudness is
    normalised before its spectrogram is cut into pieces."""
    pieces, mels = [], []
    for start, end in regions:
        region_pieces = speech_pieces([(start, end)])
        if not region_pieces:
            continue
        first = start // HOP
        region_mel = voice_mel(_loudness_normalized(samples[start:end]))
        for at, size in region_pieces:
            piece = region_mel[at - first : at - first + size]
            if piece.shape[0] >= MIN_PIECE_FRAMES:
                pieces.append((at, piece.shape[0]))
                mels.append(piece)
    prints = np.zeros((len(pieces), 256), np.float32)
    by_length: dict[int, list[int]] = {}
    for i, mel in enumerate(mels):
        by_length.setdefault(mel.shape[0], []).append(i)
    for same_length in by_length.values():  # pieces of one length together, PRINT_BATCH at a time
        for at in range(0, len(same_length), PRINT_BATCH):
            indices = same_length[at : at + PRINT_BATCH]
            prints[indices] = encoder()(np.stack([mels[i] for i in indices]))
    return pieces, prints


def cluster(prints: np.ndarray, speakers: str | int) -> np.ndarray:
    """A speaker number per voice print: ``speakers`` groups, or with "auto" the count whose clusters
    separate best."""
    n = prints.shape[0]
    if n == 0:
        return np.zeros(0, int)
    if speakers == 1 or n == 1:
        return np.zeros(n, int)
    from sklearn.cluster import AgglomerativeClustering

    def grouped(k: int) -> np.ndarray:  # Ward's linkage on unit vectors: compact groups, outliers join one
        return AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(prints)

    if speakers != "auto":
        return grouped(min(int(speakers), n))
    labels = np.zeros(n, int)  # one speaker, until a split into one more gives groups that sound apart
    for k in range(2, min(MAX_AUTO_SPEAKERS, n) + 1):
        split = grouped(k)
        if np.bincount(split).min() < MIN_SPEAKER_PIECES or _closest_groups(prints, split, k) >= SAME_SPEAKER_SIMILARITY:
            break
        labels = split
    return labels


def _closest_groups(prints: np.ndarray, labels: np.ndarray, k: int) -> float:
    """The cosine similarity of the two most alike groups' mean voice prints."""
    centres = np.stack([prints[labels == j].mean(0) for j in range(k)])
    centres /= np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
    similar = centres @ centres.T
    np.fill_diagonal(similar, -1.0)
    return float(similar.max())


def speaker_turns(samples: np.ndarray, speakers: str | int, regions: list[tuple[int, int]]) -> list[Turn]:
    """The turns of speech in ``samples`` (16 kHz) within the speech ``regions`` (sample ranges)."""
    pieces, prints = voice_prints(samples, regions)
    labels = cluster(prints, speakers)
    frames = samples.size // HOP + 1
    votes = np.zeros((frames, max(1, int(labels.max()) + 1 if labels.size else 1)), np.float32)
    for (at, size), label in zip(pieces, labels):
        centre = at + size / 2
        span = np.arange(at, min(at + size, frames))
        votes[span, label] += 1.0 / (1.0 + np.abs(span - centre) / size)  # a piece counts most at its middle
    turns: list[Turn] = []
    names: dict[int, str] = {}
    for start, end in regions:
        first, last = start // HOP, min(end // HOP, frames)
        if last <= first:
            continue
        region_votes = votes[first:last]
        if not region_votes.any():  # too short for a print of its own: the nearest piece's speaker
            label = _nearest_label(pieces, labels, (first + last) / 2)
            chosen = np.full(last - first, label)
        else:
            chosen = region_votes.argmax(1)
            unvoted = ~region_votes.any(1)
            if unvoted.any():
                chosen[unvoted] = _nearest_label(pieces, labels, (first + last) / 2)
        run_start = 0
        for i in range(1, len(chosen) + 1):
            if i == len(chosen) or chosen[i] != chosen[run_start]:
                label = int(chosen[run_start])
                name = names.setdefault(label, f"S{len(names) + 1}")
                turn = Turn((first + run_start) * HOP / SAMPLE_RATE, (first + i) * HOP / SAMPLE_RATE, name)
                if turns and turns[-1].speaker == name and turn.start - turns[-1].end < 1e-6:
                    turns[-1] = Turn(turns[-1].start, turn.end, name)
                else:
                    turns.append(turn)
                run_start = i
    return turns


def _nearest_label(pieces, labels, frame: float) -> int:
    if not pieces:
        return 0
    centres = np.array([at + size / 2 for at, size in pieces])
    return int(labels[int(np.argmin(np.abs(centres - frame)))])


def diarize(samples: np.ndarray, speakers: str | int, probabilities: np.ndarray | None = None) -> list[Turn]:
    """Speaker turns of a whole recording (16 kHz), from its voice-activity probabilities (computed here
    when not given)."""
    from engine.whisper.vad import speech_probabilities, speech_regions

    if probabilities is None:
        probabilities = speech_probabilities(samples)
    return speaker_turns(samples, speakers, speech_regions(probabilities, samples.size))


def diarize_plan(plan) -> list[Turn]:
    """A planned transcription's speaker turns; the plan's copy of the audio is let go once done."""
    samples, plan.samples = plan.samples, None
    return diarize(samples, plan.speakers, plan.speech_probabilities)


def label_segments(segments, turns: list[Turn]) -> None:
    """Each segment takes the speaker who talks longest within it (the nearest turn when none does)."""
    if not turns:
        return
    starts = np.array([t.start for t in turns])
    for segment in segments:
        overlap: dict[str, float] = {}
        for turn in turns[max(0, int(np.searchsorted(starts, segment.start)) - 1):]:
            if turn.start >= segment.end:
                break
            shared = min(turn.end, segment.end) - max(turn.start, segment.start)
            if shared > 0:
                overlap[turn.speaker] = overlap.get(turn.speaker, 0.0) + shared
        if overlap:
            segment.speaker = max(overlap, key=overlap.get)
        else:
            middle = (segment.start + segment.end) / 2
            segment.speaker = min(turns, key=lambda t: min(abs(t.start - middle), abs(t.end - middle))).speaker
