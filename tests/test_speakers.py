"""Speakers: two espeak-ng voices taking turns get two labels with at least 90% of the speech time
labelled right (their number found, or given); one voice gets one label; labels reach the outputs;
a bad speaker count is one sentence."""

import numpy as np
import pytest
import soundfile as sf
from conftest import synthesize

from app.cli import main as cli_main
from engine import TranscribeRequest
from engine.audio import SAMPLE_RATE, load_audio
from engine.errors import RequestError
from engine.formats import render
from engine.speakers import diarize, parse_speakers
from engine.subtitles import SubtitleRules

TURNS = [
    "Good morning everyone, thanks for joining the call today.",
    "Thanks for having me, I have the numbers ready.",
    "Great, let us start with the sales figures for March.",
    "Sales grew by twelve percent compared to February.",
    "That is excellent news for the whole team.",
    "We also signed two new customers in the north region.",
]
VOICES = ("en-us+f3", "en-us+m3")
PAUSE_S = 0.4


@pytest.fixture(scope="module")
def dialogue(tmp_path_factory):
    """A conversation of two voices taking turns, and each turn's (start, end, voice)."""
    folder = tmp_path_factory.mktemp("dialogue")
    parts, truth, at = [], [], 0.0
    for i, line in enumerate(TURNS):
        audio = load_audio(synthesize(line, folder / f"turn{i}.wav", VOICES[i % 2], 150))
        parts += [audio, np.zeros(int(PAUSE_S * SAMPLE_RATE), np.float32)]
        truth.append((at, at + audio.size / SAMPLE_RATE, i % 2))
        at += audio.size / SAMPLE_RATE + PAUSE_S
    path = folder / "dialogue.wav"
    sf.write(path, np.concatenate(parts), SAMPLE_RATE)
    return path, truth


def _labelled_right(spans, truth) -> float:
    """The share of speech time whose label matches the voice, under the best naming of the labels."""
    grid = np.arange(0.0, truth[-1][1], 0.01)
    voice = np.full(grid.size, -1)
    label = np.full(grid.size, -1)
    for start, end, v in truth:
        voice[(grid >= start) & (grid < end)] = v
    names = sorted({s for _, _, s in spans})
    for start, end, s in spans:
        label[(grid >= start) & (grid < end)] = names.index(s)
    speech = voice >= 0
    return max(np.mean(label[speech] == voice[speech]), np.mean(label[speech] == 1 - voice[speech]))


def test_two_voices_taking_turns_get_two_labels(engine4, dialogue):
    path, truth = dialogue
    transcript = engine4.submit(TranscribeRequest(path, timestamps=True, speakers="auto")).result(600)
    labels = {s.speaker for s in transcript.segments}
    assert labels == {"S1", "S2"} and transcript.stats["speakers"] == 2  # how many, found
    assert _labelled_right([(s.start, s.end, s.speaker) for s in transcript.segments], truth) >= 0.9
    turns = diarize(load_audio(path), 2)  # the turns themselves, the count given
    assert {t.speaker for t in turns} == {"S1", "S2"}
    assert _labelled_right([(t.start, t.end, t.speaker) for t in turns], truth) >= 0.9
    names = {"S1": "Alice", "S2": "Bob"}
    transcript.speaker_names = names
    srt, txt = render(transcript, "srt"), render(transcript, "txt")
    assert "[Alice]" in srt and "[Bob]" in srt and "Alice: " in txt and "Bob: " in txt
    assert transcript.to_json()["speakers"] == names
    narrow = SubtitleRules(max_chars=20, max_lines=2)  # the names count in the lines they start
    lines = [line for block in render(transcript, "vtt", narrow).split("\n\n")[1:] for line in block.split("\n")[1:]]
    assert sum(line.startswith(("[Alice] ", "[Bob] ")) for line in lines) >= 4 and all(len(x) <= 20 for x in lines)


def test_the_command_line_labels_speakers_and_times_words(dialogue, tmp_path, capsys):
    path, _ = dialogue
    assert cli_main(["transcribe", str(path), "--speakers", "2", "--word-timestamps", "--format", "srt",
                     "--max-line-chars", "30", "--out", str(tmp_path)]) == 0
    srt = (tmp_path / "dialogue.srt").read_text()
    lines = [line for block in srt.strip().split("\n\n") for line in block.split("\n")[2:]]
    assert "[Speaker 1] " in srt and "[Speaker 2] " in srt and all(len(line) <= 30 for line in lines)
    from engine.jobs import JobStore

    job = next(j for j in JobStore().list() if j.path == str(path.absolute()))
    segments = job.result["segments"]
    assert {s["speaker"] for s in segments} == {"S1", "S2"} and all(s["words"] for s in segments)


def test_one_voice_is_one_speaker(speech):
    turns = diarize(load_audio(speech["report"]), "auto")
    assert turns and {t.speaker for t in turns} == {"S1"}


def test_bad_speaker_counts_are_one_sentence(capsys, speech):
    for bad in ("0", "100", "many"):
        with pytest.raises(RequestError):
            parse_speakers(bad)
        assert cli_main(["transcribe", str(speech["fox"]), "--speakers", bad]) == 2
        message = capsys.readouterr().err.strip()
        assert message.startswith("cadence: --speakers:") and message.count("\n") == 0 and "Traceback" not in message
    assert parse_speakers("auto") == "auto" and parse_speakers("3") == 3 and parse_speakers("off") == "off"


def test_voice_prints_in_the_chosen_precision_match_float32_and_leave_the_threads_alone(speech):
    """The encoder runs in whichever of float32 and bfloat16 this processor runs faster (timed at load);
    its prints stay the float32 prints' (cosine ≥ 0.995), and it holds OpenMP to one thread for its own
    thread only: the caller's thread count is what it was, there and everywhere else."""
    import threading

    import torch

    from engine.speakers import PIECE_FRAMES, encoder, voice_mel

    enc = encoder()
    assert enc.dtype in (torch.float32, torch.bfloat16)
    mel = voice_mel(load_audio(speech["fox"]))
    pieces = np.stack([mel[at : at + PIECE_FRAMES] for at in range(0, mel.shape[0] - PIECE_FRAMES, PIECE_FRAMES // 2)])
    exact, chosen = enc._run(pieces, torch.float32), enc(pieces)
    assert chosen.shape == (len(pieces), 256) and np.allclose(np.linalg.norm(chosen, axis=1), 1.0, atol=1e-5)
    assert float((exact * chosen).sum(1).min()) >= 0.995
    threads = torch.get_num_threads()
    seen = []

    def beside():
        torch.ones(1 << 16).sum()
        before = torch.get_num_threads()
        enc(pieces)
        seen.append((before, torch.get_num_threads()))

    worker = threading.Thread(target=beside)
    worker.start()
    worker.join()
    # (A new thread starts with OpenMP's default count, which another library in this process may have
    # changed for the test's own thread, e.g. CTranslate2: so each thread is compared with itself.)
    [(before, after)] = seen
    assert before == after and torch.get_num_threads() == threads
