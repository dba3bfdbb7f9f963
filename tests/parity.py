"""The near-tie rule the exactness tests share.

Two decoders with different (equally correct) floating-point kernels may pick different tokens
only where the two best candidates are within 1e-3 of each other. At the first differing token,
recompute the reference's logits (with the request's penalties applied as they stood there) and
require such a near-tie; any other difference is a masking, position or sampling bug.
"""

import torch

from engine.picking import TokenPicker
from engine.sampling import SamplingParams

NEAR_TIE = 1e-3


def assert_same_or_near_tie(chat_ref, prompt_ids, got, want, params: SamplingParams | None = None):
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-2])) if a != b)
    picker = TokenPicker(params or SamplingParams(), prompt_ids)
    with torch.inference_mode():
        logits = chat_ref.model(torch.tensor([prompt_ids + want[:i]])).logits[0, -1]
        picker.penalize(logits)  # sets up the penalty state from the prompt
        for token in want[:i]:
            picker.observe(token)
        logits = picker.penalize(logits)
    top2 = torch.topk(logits.float(), 2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"token {i} differs with a logit gap of {gap:.4g}: a masking or position bug"


def clip_timestamps(path) -> list[float]:
    """Cadence's voice-activity windows of a file as faster-whisper's ``clip_timestamps`` (start, end,
    start, end, ... in seconds), so that faster-whisper decodes exactly the same windows."""
    from engine.audio import load_audio
    from engine.whisper.pipeline import plan_windows
    from engine.whisper.features import FRAMES_PER_SECOND, log_mel

    audio = load_audio(path)
    return [x for seek, size, _ in plan_windows(log_mel(audio), audio, "vad")
            for x in (seek / FRAMES_PER_SECOND, (seek + size) / FRAMES_PER_SECOND)]
