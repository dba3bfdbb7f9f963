"""Whisper's timestamp tokens: the rules that keep them well formed while decoding, and the timed
segments read back from them.

With timestamps on, the prompt ends without ``<|notimestamps|>`` and the model writes each phrase
between two time tokens, ``<|0.00|> Hello there.<|1.84|><|1.84|> How are you?<|3.10|>``, in steps of
20 ms from the window's start. The rules are the ones faster-whisper decodes with (CTranslate2's),
applied after token suppression, so Cadence's timed tokens equal its own on the same windows:

- ``<|notimestamps|>`` is never written;
- the first token is a time of at most MAX_INITIAL_TIMESTAMP s;
- times come in pairs: after a lone time only a time or the end may follow, after a pair only text;
- times never go back;
- where the time tokens together are likelier than any single text token, a time is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

TIME_PRECISION = 0.02  # seconds per time token
MAX_INITIAL_TIMESTAMP = 1.0  # the first time token is at most this far into the window (seconds)


@dataclass(frozen=True)
class TimestampRules:
    eot: int
    no_timestamps: int
    begin: int  # <|0.00|>; every id from here to ``end`` is a time
    end: int
    max_initial: int  # the latest time the first token may be

    @classmethod
    def of(cls, tok) -> "TimestampRules":
        begin = tok.no_timestamps + 1
        return cls(eot=tok.eot, no_timestamps=tok.no_timestamps, begin=begin, end=tok.vocab_size - 1,
                   max_initial=begin + round(MAX_INITIAL_TIMESTAMP / TIME_PRECISION))

    def apply(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """Mask ``logits`` [V] in place for the token after ``generated`` (this window's tokens so far)."""
        inf = -float("inf")
        logits[self.no_timestamps] = inf
        if not generated:
            logits[: self.begin] = inf
            logits[self.max_initial + 1 : self.end + 1] = inf
            return logits
        compare = True
        if generated[-1] >= self.begin:
            before = generated[-2] if len(generated) >= 2 else generated[-1]
            if before >= self.begin:  # a pair just closed: text must follow
                logits[self.begin : self.end + 1] = inf
                compare = False
            else:  # a lone time closed a phrase: another time or the end, not text
                logits[: self.eot] = inf
        last_time = next((t for t in reversed(generated) if t >= self.begin), None)
        if last_time is not None:
            logits[self.begin : last_time] = inf
        if compare:
            logprobs = torch.log_softmax(logits.float(), -1)
            if torch.logsumexp(logprobs[self.begin : self.end + 1], -1) > logprobs[: self.begin].max():
                logits[: self.begin] = inf
        return logits

    def resume_point(self, tokens: Sequence[int]) -> int | None:
        """Where, in time steps from the start of what was decoded, the model left off when it ended on a
        pair of times (a phrase closed and the next one opened but left for a next window, as it does
        when it expects the decoding to go on from there); None when it ended otherwise."""
        if len(tokens) >= 2 and tokens[-1] >= self.begin and tokens[-2] >= self.begin:
            return tokens[-1] - self.begin
        return None

    def join(self, first: Sequence[int], rest: Sequence[int], steps: int) -> list[int]:
        """``first`` (ending on a pair of times) continued by ``rest``, which was decoded from ``steps`` time
        steps after first's start, with rest's times moved onto first's clock. Every decoded token is kept
        (the pair's opening time is then followed by rest's own, which :meth:`segments` reads as the
        phrase's start)."""
        return list(first) + [min(t + steps, self.end) if t >= self.begin else t for t in rest]

    def text_only(self, tokens: Sequence[int]) -> list[int]:
        return [t for t in tokens if t < self.begin]

    def segments(self, tokens: Sequence[int], start: float, end: float) -> list[tuple[float, float, list[int]]]:
        """(start s, end s, tokens) of each phrase of a window that spans ``start``..``end`` seconds of the
        file. A phrase the window ended before its closing time runs to the window's end; times are kept
        inside the window and never go back."""
        phrases: list[tuple[float, float, list[int]]] = []
        opened: float | None = None
        text: list[int] = []
        for t in tokens:
            if t < self.begin:
                text.append(t)
                continue
            at = min(max(start + (t - self.begin) * TIME_PRECISION, start), end)
            if text:
                begun = opened if opened is not None else (phrases[-1][1] if phrases else start)
                phrases.append((begun, max(at, begun), text))
                text, opened = [], None
            else:
                opened = at
        if text:
            begun = opened if opened is not None else (phrases[-1][1] if phrases else start)
            phrases.append((begun, end, text))
        return phrases
