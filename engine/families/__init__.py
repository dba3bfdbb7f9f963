"""Model families behind the batched seam: each file writes its layers, none writes batching."""

from __future__ import annotations


def decoder_class(loaded):
    """The batched decoder class for a loaded model: Whisper, or the chat family its config's
    model_type names (engine.models.CHAT_ARCHITECTURES); one sentence (ModelError) for any other."""
    from engine.models import CHAT, chat_architecture

    if loaded.family != CHAT:
        from engine.families.whisper import WhisperBatched

        return WhisperBatched
    architecture = chat_architecture(loaded.model.config.to_dict(), loaded.source.name)
    if architecture == "llama":
        from engine.families.llama import LlamaBatched as Decoder
    elif architecture == "mistral":
        from engine.families.llama import MistralBatched as Decoder
    elif architecture == "smollm3":
        from engine.families.llama import SmolLM3Batched as Decoder
    elif architecture == "qwen2":
        from engine.families.qwen import Qwen2Batched as Decoder
    elif architecture == "qwen3":
        from engine.families.qwen import Qwen3Batched as Decoder
    elif architecture == "gemma3_text":
        from engine.families.gemma import Gemma3Batched as Decoder
    elif architecture == "gemma2":
        from engine.families.gemma import Gemma2Batched as Decoder
    else:  # "phi3": chat_architecture admits nothing else
        from engine.families.phi3 import Phi3Batched as Decoder
    return Decoder
