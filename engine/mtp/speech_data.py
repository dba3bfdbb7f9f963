"""Data for Whisper MTP heads: text spoken by espeak-ng (some with sox's noise) and transcribed greedily
by the model itself on the path its recipe names, with the decoder's hidden state at every position
(see :mod:`engine.mtp.data` for the shards, the chat data and the format)."""

from __future__ import annotations

import math
import random
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.errors import CadenceError
from engine.mtp.data import SeqData, _shards, chat_parts, load_frozen, speech_prefix, work_dir
from engine.mtp.progress import quiet
from engine.mtp.recipe import Recipe, recipe_for

VOICES = ["en-us+f3", "en-us+m3", "en-us+f2", "en-us+m1", "en-gb+f3", "en-gb+m3", "en-us", "en-gb-x-rp+f4",
          "en-us+m7", "en-gb-scotland+f1"]
SPLITS = {"train": 0, "heldout": 1, "val": 2}


def speech_pieces(text: str, rng: random.Random) -> list[str]:
    """Plain sentences of an answer, grouped into pieces of 12 to about 80 words (code and markup left out)."""
    text = re.sub(r"```.*?(```|$)", " ", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        if re.search(r"[{}=;<>\[\]_\\|]|def |return |\w\(|\)\s*$", line):
            continue
        line = re.sub(r"^\s*(#+|\*+|-|\d+[.)])\s*", "", line)
        line = line.replace("**", "").replace("`", "").replace("*", "")
        if line.strip():
            lines.append(line.strip())
    sentences = [s for s in re.split(r"(?<=[.!?:])\s+", " ".join(lines)) if s]
    pieces, words = [], []
    limit = rng.randint(40, 80)
    for s in sentences:
        w = s.split()
        if words and len(words) + len(w) > limit:
            pieces.append(words)
            words, limit = [], rng.randint(40, 80)
        words += w[:80]
    if words:
        pieces.append(words)
    out = []
    for p in pieces:
        piece = " ".join(p)
        if len(p) >= 12 and sum(c.isascii() for c in piece) > 0.98 * len(piece) and re.search(r"[a-zA-Z]{3}", piece):
            out.append(piece)
    return out


def speech_texts(split: str, seed: int, count: int, progress) -> list[str]:
    """``count`` pieces of English text for speech of one split (train, val, heldout): the default chat
    model's answers to that split's prompts (the first batch of training prompts for train) and the
    split's paragraphs; the chat model's data is made first when missing."""
    from engine.models import DEFAULT_CHAT
    from engine.mtp.prompts import texts_for_speech

    recipe, source = recipe_for(DEFAULT_CHAT)
    progress(f"speech text: {DEFAULT_CHAT}'s answers to the {split} prompts", force=True)
    part = {"train": "first", "val": "val", "heldout": "held"}[split]
    answers = chat_parts(source, recipe, work_dir(source), progress, (part,))[part].texts
    rng = random.Random(seed * 7919 + SPLITS[split])
    pieces = []
    for text in answers + (texts_for_speech(split == "heldout") if split != "val" else []):
        pieces += speech_pieces(text, rng)
    rng.shuffle(pieces)
    return pieces[:count]


NOISES = ("pinknoise", "brownnoise", "whitenoise")


def synthesize(text: str, out: Path, voice: str, rate: int, noise: tuple[str, float] | None = None) -> Path:
    """``text`` spoken by espeak-ng as 16-kHz mono WAV at ``out``, the same bytes every time: sox dithers
    when it resamples, from a random seed unless told to repeat itself (-R). ``noise`` (kind, dB): sox's
    synthetic noise of that kind (one of NOISES) mixed in that many dB below the speech's RMS."""
    raw = out.with_suffix(".raw.wav")
    made = [raw]
    try:
        subprocess.run(["espeak-ng", "-w", str(raw), "-v", voice, "-s", str(rate), text], check=True,
                       capture_output=True)
        if noise is None:
            subprocess.run(["sox", "-R", str(raw), "-r", "16000", "-c", "1", str(out)], check=True,
                           capture_output=True)
            return out
        kind, below_db = noise
        clean, hiss = out.with_suffix(".clean.wav"), out.with_suffix(".noise.wav")
        made += [clean, hiss]
        subprocess.run(["sox", "-R", str(raw), "-r", "16000", "-c", "1", str(clean)], check=True, capture_output=True)
        speech_rms, samples = _rms_and_samples(clean)
        subprocess.run(["sox", "-R", "-r", "16000", "-c", "1", "-n", "-b", "16", str(hiss), "synth", f"{samples}s",
                        kind, "vol", "0.5"], check=True, capture_output=True)
        gain = speech_rms / max(_rms_and_samples(hiss)[0], 1e-9) * 10 ** (-below_db / 20)
        subprocess.run(["sox", "-R", "-m", "-v", "1", str(clean), "-v", f"{gain:.6f}", str(hiss), str(out)],
                       check=True, capture_output=True)
    except FileNotFoundError as exc:
        raise CadenceError(f"Training a Whisper draft head needs espeak-ng and sox installed ({exc.filename} "
                           "was not found).") from None
    finally:
        for path in made:
            path.unlink(missing_ok=True)
    return out


def _rms_and_samples(path: Path) -> tuple[float, int]:
    import numpy as np
    import soundfile

    samples = soundfile.read(str(path), dtype="float32")[0]
    return float(np.sqrt(np.mean(np.square(samples)))) if samples.size else 0.0, samples.size


class _WhisperMaker:
    """Speech of the split's texts, transcribed greedily by the model itself with its hidden states. With
    ``timestamps`` (the recipe's; the engine's default path) each clip is one voice-activity window and
    the model writes time tokens under the engine's rules; without, one fixed window and no times.
    ``noisy``: the share of clips with noise mixed in (seeded per clip like its voice)."""

    def __init__(self, loaded, seed: int, progress=quiet, language: str = "en", timestamps: bool = False,
                 noisy: float = 0.0):
        from engine.whisper.reference import WhisperReference

        self.loaded = loaded
        self.ref = WhisperReference(self.loaded)
        self.seed, self.progress, self.language = seed, progress, language
        self.timestamps, self.noisy = timestamps, noisy

    def __call__(self, items: list[tuple[int, str]], n: int) -> SeqData:
        from engine.audio import load_audio
        from engine.whisper.pipeline import plan_transcription

        windows, prompt, texts = [], None, []
        with tempfile.TemporaryDirectory(prefix="cadence-mtp-") as tmp:
            for k, (index, text) in enumerate(items):
                rng = random.Random(self.seed * 1_000_003 + index)
                voice, rate = rng.choice(VOICES), rng.randrange(120, 176, 5)
                noise = (rng.choice(NOISES), rng.uniform(10, 30)) if rng.random() < self.noisy else None
                text = " ".join(text.split()[: int(rate * 0.45)])  # at most 27 s: one window
                wav = synthesize(text, Path(tmp) / f"{k}.wav", voice, rate, noise)
                plan = plan_transcription(self.ref, load_audio(wav), self.language, "transcribe", wav.name,
                                          windowing="vad" if self.timestamps else "fixed", timestamps=self.timestamps)
                if not plan.spans:  # no speech found (never for espeak-ng's voices; kept out rather than guessed)
                    continue
                prompt = plan.prompt
                windows.append(torch.from_numpy(plan.spans[0][2]))
                texts.append(f"{voice} {rate}{f' {noise[0]} -{noise[1]:.0f} dB' if noise else ''}: {text}")
                self.progress(f"speech shard {n + 1}: {k + 1}/{len(items)} clips spoken")
        parts = []
        for b in range(0, len(windows), 8):
            parts.append(self._decode(torch.stack(windows[b : b + 8]), prompt))
            self.progress(f"speech shard {n + 1}: {min(b + 8, len(windows))}/{len(windows)} clips transcribed, "
                          f"{sum(int(p.lengths.sum()) for p in parts)} tokens")
        data = SeqData.concat(parts)
        data.texts = texts
        return data

    @torch.inference_mode()
    def _decode(self, feats: torch.Tensor, prompt: list[int], max_new: int = 224) -> SeqData:
        """Greedy transcription of B windows at once (the engine's rules, time tokens' included when the
        prompt asks for them), keeping each position's hidden state."""
        model, ref = self.loaded.model, self.ref
        rules = ref.timestamp_rules(prompt)
        B = feats.shape[0]
        enc = model.model.encoder(input_features=feats).last_hidden_state
        ids = torch.tensor([prompt] * B)
        out = model.model.decoder(input_ids=ids, encoder_hidden_states=enc, use_cache=True)
        cache, h = out.cache, out.last_hidden_state[:, -1]
        hiddens, tokens = [], []
        written: list[list[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        lengths = torch.zeros(B, dtype=torch.long)
        for step in range(max_new):
            logits = model.proj_out(h).float()
            logits[:, ref.suppress] = -float("inf")
            if step == 0:
                logits[:, ref.begin_suppress] = -float("inf")
            if rules is not None:
                for r in range(B):
                    if not done[r]:
                        rules.apply(logits[r], written[r])
            tok = logits.argmax(-1)
            hiddens.append(h.float().clone())
            tokens.append(tok)
            for r in range(B):
                if not done[r]:
                    written[r].append(int(tok[r]))
            lengths += (~done).long()
            done |= tok == ref.tok.eot
            if bool(done.all()):
                break
            out = model.model.decoder(input_ids=tok[:, None], encoder_hidden_states=enc, cache=cache, use_cache=True)
            cache, h = out.cache, out.last_hidden_state[:, -1]
        H, T = torch.stack(hiddens, 1), torch.stack(tokens, 1)  # [B, steps, d], [B, steps]
        keep = [r for r in range(B) if lengths[r] > 1]
        return SeqData(torch.cat([H[r, : lengths[r]] for r in keep]), torch.cat([T[r, : lengths[r]] for r in keep]),
                       torch.cat([T[r, : lengths[r]] for r in keep]), lengths[keep].clone())


def whisper_data(source, recipe: Recipe, folder: Path, seed: int, progress) -> tuple[SeqData, SeqData, SeqData]:
    """(training, validation, held-out) speech of a Whisper model, transcribed by itself."""
    maker = None
    out = []
    for split, count in (("train", recipe.train_clips), ("val", recipe.val_clips), ("heldout", recipe.heldout_clips)):
        prefix = speech_prefix(recipe, split)
        if all((folder / f"{prefix}-{n:03d}.safetensors").is_file() for n in range(math.ceil(count / 32))):
            items = [(0, "")] * count  # every shard is there: no text needed
        else:
            items = [(i + (SPLITS[split] << 20), t) for i, t in enumerate(speech_texts(split, seed, count, progress))]

        def make(chunk, n):
            nonlocal maker
            if maker is None:
                maker = _WhisperMaker(load_frozen(source), seed, progress, timestamps=recipe.timestamps,
                                      noisy=recipe.noisy)
            return maker(chunk, n)

        out.append(_shards(folder, prefix, items, 32, make, progress, f"speech {split} data"))
    return out[0], out[1], out[2]


def speech_sample(loaded, texts: list[str], seed: int = 0, timestamps: bool | None = None) -> SeqData:
    """Speech of a few texts (clean), transcribed greedily by a loaded Whisper model, with hidden states;
    on the path its recipe trains on unless ``timestamps`` says."""
    if timestamps is None:
        timestamps = recipe_for(loaded.source.name)[0].timestamps
    return _WhisperMaker(loaded, seed, timestamps=timestamps)([(i, t) for i, t in enumerate(texts)], 0)
