"""Word timestamps from the decoder's cross-attention, as Whisper and faster-whisper compute them.

A few cross-attention heads of Whisper's decoder (the *alignment heads*, found by OpenAI per model
size) look at the audio frames where the token they predict is spoken. After a window is decoded,
its text tokens are run through the decoder once more behind ``sot ... <|notimestamps|>`` (no time
tokens), and those heads' attention over the window's frames is collected for every row:

1. softmax over the frames that hold the window's audio (half the mel frames: the encoder halves them);
2. each head standardised over the rows (zero mean, unit variance), then a median filter of width 7
   along the frames;
3. the heads averaged into one [rows, frames] matrix, of which the rows that predict a text token
   (and the end) are kept;
4. dynamic time warping finds the monotonic path through the matrix with the most attention; a word
   starts at the frame where the path first reaches its first token, and ends where the next word starts.

Then the rules faster-whisper applies: punctuation joins its word, a word at a sentence end or
after a long pause is not allowed to stretch over the silence. Times here are seconds from the
start of the decoded audio; the caller moves them onto the file's clock.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import RequestError

MEDIAN_FILTER_WIDTH = 7
TIME_PER_FRAME = 0.02  # seconds per encoder frame (two mel frames)
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_ENDS = ".。!！?？"
NO_SPACE_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}

# The heads OpenAI published per model (hub models also carry them in generation_config.json,
# CTranslate2 models in config.json, which are read first).
KNOWN_HEADS: dict[str, list[tuple[int, int]]] = {
    "whisper-tiny.en": [(1, 0), (2, 0), (2, 5), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4)],
    "whisper-tiny": [(2, 2), (3, 0), (3, 2), (3, 3), (3, 4), (3, 5)],
    "whisper-base.en": [(3, 3), (4, 7), (5, 1), (5, 5), (5, 7)],
    "whisper-base": [(3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6)],
    "whisper-small": [(5, 3), (5, 9), (8, 0), (8, 4), (8, 7), (8, 8), (9, 0), (9, 7), (9, 9), (10, 5)],
    "whisper-medium": [(13, 15), (15, 4), (15, 15), (16, 1), (20, 0), (23, 4)],
    "whisper-large-v3": [(7, 0), (10, 17), (12, 18), (13, 12), (16, 1), (17, 14), (19, 11), (21, 4), (24, 1), (25, 6)],
    "whisper-large-v3-turbo": [(2, 4), (2, 11), (3, 3), (3, 6), (3, 11), (3, 14)],
}


@dataclass
class WordTiming:
    """A word of a decoded stretch: seconds from that stretch's start, and how many text tokens it holds."""

    text: str
    start: float
    end: float
    probability: float
    tokens: int

    def moved(self, seconds: float) -> "WordTiming":
        return WordTiming(self.text, self.start + seconds, self.end + seconds, self.probability, self.tokens)

    def to_list(self) -> list:
        return [self.text, round(self.start, 3), round(self.end, 3), round(self.probability, 4), self.tokens]

    @classmethod
    def from_list(cls, item: list) -> "WordTiming":
        return cls(str(item[0]), float(item[1]), float(item[2]), float(item[3]), int(item[4]))


# ---------------------------------------------------------------------------- which heads
def alignment_heads(loaded) -> list[tuple[int, int]] | None:
    """The model's alignment heads as (decoder layer, head), or None when it has none known: from the
    CTranslate2 config (kept beside converted weights), the transformers generation config, or the
    published heads of a named model."""
    folder = Path(loaded.report.cache_path or loaded.source.folder)
    for path, key in ((folder / "ct2_config.json", "alignment_heads"), (loaded.source.folder / "config.json",
                      "alignment_heads"), (folder / "generation_config.json", "alignment_heads")):
        try:
            heads = json.loads(path.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if heads:
            return _checked(heads, loaded)
    heads = KNOWN_HEADS.get(loaded.source.name)
    return _checked(heads, loaded) if heads else None


def _checked(heads, loaded) -> list[tuple[int, int]] | None:
    cfg = loaded.model.config
    pairs = [(int(layer), int(head)) for layer, head in heads]
    if all(0 <= layer < cfg.decoder_layers and 0 <= head < cfg.decoder_attention_heads for layer, head in pairs):
        return pairs
    return None  # heads of another size (a fine-tuned copy with fewer layers): not usable


def require_heads(loaded) -> list[tuple[int, int]]:
    heads = alignment_heads(loaded)
    if heads is None:
        raise RequestError(f"{loaded.source.name} has no known alignment heads, so it cannot time words "
                           f"(transcribe without word timestamps).")
    return heads


def alignment_prompt(sot_sequence: list[int], no_timestamps: int, text: list[int], eot: int) -> list[int]:
    """What the decoder reads to align ``text``: the start of transcript, no time tokens, the text, the end."""
    return list(sot_sequence) + [no_timestamps] + list(text) + [eot]


# ---------------------------------------------------------------------------- the matrix and its path
def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """Median over ``width`` neighbours along the last axis, edges mirrored (without repeating the edge)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.median(windows, axis=-1)


def attention_matrix(scores: np.ndarray, frames: int, first_row: int, rows: int) -> np.ndarray:
    """[rows, frames] of averaged, standardised, filtered attention from raw per-head scores
    [heads, all prompt rows, >= frames] (query . key / sqrt(d)), keeping ``rows`` rows from ``first_row``."""
    x = scores[:, :, :frames].astype(np.float64)
    x = np.exp(x - x.max(-1, keepdims=True))
    x /= x.sum(-1, keepdims=True)
    mean = x.mean(-2, keepdims=True)
    std = x.std(-2, keepdims=True)
    x = (x - mean) / np.where(std > 0, std, 1.0)
    x = median_filter(x, MEDIAN_FILTER_WIDTH)
    return x.mean(0)[first_row : first_row + rows]


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path from (0, 0) to the last cell through ``cost`` [N, M], moving down,
    right or diagonally; (row indices, column indices) along it.

    Row by row: with ``up`` the cheaper of the cell above-left and above, a row's totals are
    D[j] = x[j] + min(up[j], D[j-1]) = S[j] + running minimum of (up[l] + x[l] - S[l]) for S the
    running sum of the row, so each row is a few array operations rather than a loop over cells.
    Ties go to the diagonal, then up, then left (Whisper's order)."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)
    for i in range(1, n + 1):
        diag, up_cell = total[i - 1, :-1], total[i - 1, 1:]
        best_above = np.minimum(diag, up_cell)
        x = cost[i - 1]
        running = np.cumsum(x)
        total[i, 1:] = running + np.minimum.accumulate(best_above + x - running)
        left = total[i, :-1]
        choice = np.full(m, 2, dtype=np.int8)
        choice[(diag < up_cell) & (diag < left)] = 0
        choice[(up_cell < diag) & (up_cell < left)] = 1
        trace[i, 1:] = choice
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    path = np.array(path[::-1])
    return path[:, 0], path[:, 1]


# ---------------------------------------------------------------------------- words
def split_words(tok, tokens: list[int], language: str | None) -> tuple[list[str], list[list[int]]]:
    """Tokens grouped into words: a new word at a leading space or a punctuation mark (or at every
    complete character, in languages written without spaces). Special tokens stand alone."""
    pieces, piece_tokens, current = [], [], []
    full = tok.decode(tokens)
    at = 0  # characters of ``full`` behind the pieces so far
    for t in tokens:
        current.append(t)
        if t >= tok.eot:
            text = "<|endoftext|>" if t == tok.eot else ""
        else:
            text = tok.decode(current)
            bad = text.find("\ufffd")  # a character cut between tokens: wait for the rest of it
            if bad >= 0 and not (at + bad < len(full) and full[at + bad] == "\ufffd"):
                continue
            at += len(text)
        pieces.append(text)
        piece_tokens.append(current)
        current = []
    if language in NO_SPACE_LANGUAGES:
        return pieces, piece_tokens
    words, word_tokens = [], []
    for text, ids in zip(pieces, piece_tokens):
        if ids[0] >= tok.eot or text.startswith(" ") or text.strip() in string.punctuation or not words:
            words.append(text)
            word_tokens.append(list(ids))
        else:
            words[-1] += text
            word_tokens[-1].extend(ids)
    return words, word_tokens


def _merge_punctuation(words: list[dict]) -> None:
    """Opening marks join the word after them, closing marks the word before (both in place; the
    emptied entries keep no text and no tokens)."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        before, after = words[i], words[j]
        if before["word"].startswith(" ") and before["word"].strip() in PREPEND_PUNCTUATIONS:
            after["word"], after["tokens"] = before["word"] + after["word"], before["tokens"] + after["tokens"]
            before["word"], before["tokens"] = "", 0
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        before, after = words[i], words[j]
        if not before["word"].endswith(" ") and after["word"] in APPEND_PUNCTUATIONS:
            before["word"], before["tokens"] = before["word"] + after["word"], before["tokens"] + after["tokens"]
            after["word"], after["tokens"] = "", 0
        else:
            i = j
        j += 1


def align_words(tok, text: list[int], scores: np.ndarray, content_frames: int, sot_length: int,
                probabilities: list[float], language: str | None) -> list[WordTiming]:
    """The words of ``text`` (a decoded stretch's text tokens) with their times, from the alignment
    heads' raw scores [heads, prompt rows, frames] over :func:`alignment_prompt`'s rows. ``content_frames``:
    mel frames of audio in the stretch; ``probabilities``: each text token's, as decoded."""
    if not text:
        return []
    frames = max(1, content_frames // 2)
    matrix = attention_matrix(scores, frames, sot_length, len(text) + 1)
    rows, columns = dtw_path(-matrix)
    words, word_tokens = split_words(tok, list(text) + [tok.eot], language)
    if len(word_tokens) <= 1:
        return []
    boundaries = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
    jump_times = columns[jumps] * TIME_PER_FRAME
    starts, ends = jump_times[boundaries[:-1]], jump_times[boundaries[1:]]
    probs = list(probabilities) + [0.0] * (len(text) + 1 - len(probabilities))
    timed = [{"word": w, "tokens": len(ids), "start": float(s), "end": float(e),
              "probability": float(np.mean(probs[a:b])) if b > a else 0.0}
             for w, ids, s, e, a, b in zip(words, word_tokens, starts, ends, boundaries[:-1], boundaries[1:])]
    _limit_long_words(timed)
    _merge_punctuation(timed)
    return [WordTiming(w["word"], w["start"], w["end"], w["probability"], w["tokens"]) for w in timed
            if w["word"] or w["tokens"]]


def _median_duration(timed) -> tuple[float, float]:
    durations = np.array([w["end"] - w["start"] for w in timed])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    return median, median * 2


def _limit_long_words(timed: list[dict]) -> None:
    """A word at a sentence boundary does not last more than twice the median word."""
    median, longest = _median_duration(timed)
    if not median:
        return
    for i in range(1, len(timed)):
        if timed[i]["end"] - timed[i]["start"] > longest:
            if timed[i]["word"] in SENTENCE_ENDS:
                timed[i]["end"] = timed[i]["start"] + longest
            elif timed[i - 1]["word"] in SENTENCE_ENDS:
                timed[i]["start"] = timed[i]["end"] - longest


def fit_phrase(words: list[WordTiming], start: float, end: float, last_speech: float,
               median: float) -> tuple[float, float]:
    """faster-whisper's rules at a phrase's edges (``words`` on the same clock as the phrase, changed in
    place): the first word after a pause, or a first or last word much longer than the phrase's own
    times allow, is shortened; the phrase then takes its words' times. Returns the phrase's (start, end)."""
    if not words:
        return start, end
    longest = median * 2
    first = words[0]
    if first.end - last_speech > median * 4 and (
            first.end - first.start > longest or (len(words) > 1 and words[1].end - first.start > longest * 2)):
        if len(words) > 1 and words[1].end - words[1].start > longest:
            boundary = max(words[1].end / 2, words[1].end - longest)
            first.end = words[1].start = boundary
        first.start = max(0.0, first.end - longest)
    if start < first.end and start - 0.5 > first.start:
        first.start = max(0.0, min(first.end - median, start))
    else:
        start = first.start
    last = words[-1]
    if end > last.start and end + 0.5 < last.end:
        last.end = max(last.start + median, end)
    else:
        end = last.end
    return start, end


def median_word(words: list[WordTiming]) -> float:
    durations = [w.end - w.start for w in words if w.end > w.start]
    return min(0.7, float(np.median(durations))) if durations else 0.0
