"""Whisper's special tokens, found by name in ``tokenizer.json`` (no hard-coded ids)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from engine.errors import ModelError


@dataclass
class WhisperTokenizer:
    tokenizer: Tokenizer
    vocab_size: int
    sot: int
    eot: int
    transcribe: int
    translate: int
    sot_prev: int
    sot_lm: int
    no_speech: int
    no_timestamps: int
    languages: dict[str, int] = field(default_factory=dict)  # "en" -> token id
    begin_suppress: tuple[int, ...] = ()

    @property
    def multilingual(self) -> bool:
        return self.vocab_size >= 51865

    @classmethod
    def from_folder(cls, folder: Path, vocab_size: int) -> "WhisperTokenizer":
        path = Path(folder) / "tokenizer.json"
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelError(f"{path} cannot be read as a tokenizer.") from exc

        def tid(text: str, *alts: str) -> int:
            for t in (text, *alts):
                i = tok.token_to_id(t)
                if i is not None:
                    return i
            raise ModelError(f"{path} lacks the special token {text}.")

        sot = tid("<|startoftranscript|>")
        translate = tid("<|translate|>")
        languages = {}
        for i in range(sot + 1, translate):
            content = tok.id_to_token(i)
            if content and content.startswith("<|") and content.endswith("|>"):
                languages[content[2:-2]] = i
        eot = tid("<|endoftext|>")
        begin = (tok.encode(" ", add_special_tokens=False).ids[0], eot)
        ct2_config = Path(folder) / "ct2_config.json"
        if not ct2_config.is_file():
            ct2_config = Path(folder) / "config.json"
        try:
            begin = tuple(json.loads(ct2_config.read_text()).get("suppress_ids_begin") or begin)
        except (OSError, ValueError):
            pass
        return cls(
            tokenizer=tok,
            vocab_size=vocab_size,
            sot=sot,
            eot=eot,
            transcribe=tid("<|transcribe|>"),
            translate=translate,
            sot_prev=tid("<|startofprev|>"),
            sot_lm=tid("<|startoflm|>"),
            no_speech=tid("<|nospeech|>", "<|nocaptions|>"),
            no_timestamps=tid("<|notimestamps|>"),
            languages=languages,
            begin_suppress=begin,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if int(i) < self.eot])

    def sot_sequence(self, language: str | None, task: str = "transcribe") -> list[int]:
        seq = [self.sot]
        if self.multilingual:
            if language not in self.languages:
                raise ModelError(f"Language '{language}' is not one this model knows.")
            seq += [self.languages[language], self.translate if task == "translate" else self.transcribe]
        return seq

    def non_speech_tokens(self) -> list[int]:
        """Tokens of speaker tags, music marks and brackets that are never spoken words.

        The rule OpenAI's Whisper uses: single-token symbols (alone or after a space) plus the
        first token of the musical symbols; hyphen and quote allowed inside words.
        """
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        musical = set("♩♪♫♬♭♮♯")
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(musical):
            for ids in (self.encode(symbol), self.encode(" " + symbol)):
                if len(ids) == 1 or symbol in musical:
                    result.add(ids[0])
        return sorted(result)

    def suppressed_tokens(self) -> list[int]:
        """Tokens never emitted while transcribing (the usual ``suppress_tokens=[-1]`` set)."""
        extra = [self.transcribe, self.translate, self.sot, self.sot_prev, self.sot_lm, self.no_speech]
        return sorted(set(self.non_speech_tokens()) | set(extra))
