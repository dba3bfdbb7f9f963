"""What a Whisper window's sequence carries beyond a plain one (``Sequence.window``), read by the lane."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class WindowState:
    """What a Whisper window needs beyond a plain sequence, attached to it as ``Sequence.window``: the
    logits of one prompt row (the no-speech check) and the sum of its chosen tokens' log-probabilities
    (the confidence check)."""

    probe_row: int  # the prompt row whose logits are kept
    probe_logits: torch.Tensor | None = None
    logprob_sum: float = 0.0
    token_probs: list[float] | None = None  # each token's probability as chosen, where words are timed
    # Word alignment: once decoded, the window's text is read again in its slot (the prompt is all it
    # runs) and the alignment heads' cross-attention scores of its rows are kept, a tensor per step.
    aligning: bool = False
    attention: list[torch.Tensor] = field(default_factory=list)
