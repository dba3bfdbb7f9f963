"""Token ids to streamed text: deltas that never change afterwards, and stop strings.

A byte-level tokenizer can split one character over several tokens, and a stop string can span
tokens, so a delta holds back an incomplete character at the end and any tail that could still
grow into a stop string. When a stop string appears, the text ends just before it.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # the final text once stopped, else the text decoded so far
        self.emitted = 0  # characters of text already handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that is now certain (possibly empty)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        self.text = text
        safe = len(text)
        if self.stop:
            # Look for a stop string in the part that can contain a new one.
            start = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                self.text = text[: min(hits)]
                safe = len(self.text)
            else:  # hold back a tail that is the beginning of some stop string
                for s in self.stop:
                    for n in range(min(len(s) - 1, len(text)), 0, -1):
                        if text.endswith(s[:n]):
                            safe = min(safe, len(text) - n)
                            break
        delta = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def flush(self) -> str:
        """At the end of the answer: whatever was held back (an incomplete stop string is just text)."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
