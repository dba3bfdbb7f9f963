"""Token ids to streamed text: deltas that never change afterwards, and stop strings.

A byte-level tokenizer can split one character over several tokens, and a stop string can span
tokens, so a delta holds back an incomplete character at the end and any tail that could still
grow into a stop string. When a stop string appears, the text ends just before it.

Each token decodes only the few tokens since the last complete character (the new text is the
difference between decoding them with and without the newest ones), so a long answer costs the
same per token as a short one.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self._prefix = 0  # tokens[_prefix:_read] are decoded again as context for the next ones
        self._read = 0  # tokens turned into text so far
        self._decoded = ""  # their text
        self.text = ""  # the final text once stopped, else the text decoded so far
        self.emitted = 0  # characters of text already handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that is now certain (possibly empty)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.tokens[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):  # nothing new, or an incomplete character
            return ""
        text = self._decoded = self._decoded + after[len(before) :]
        self._prefix, self._read = self._read, len(self.tokens)
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
