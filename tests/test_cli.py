"""The ``cadence`` console script, run as a user runs it, and its documented output schema."""

import json
import subprocess
import sys

import pytest


def cadence(*args, check_rc=None):
    proc = subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=600)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def test_models_json():
    rows = json.loads(cadence("models", "--json", check_rc=0).stdout)
    assert {r["name"] for r in rows} == {"whisper-tiny.en", "whisper-base", "smollm2-135m-instruct"}
    for r in rows:
        assert {"name", "family", "source", "available"} <= set(r)
        assert r["available"] is True


def test_transcribe_json_schema_and_partial_failure(speech, tmp_path, tiny):
    garbage = tmp_path / "noise.wav"
    garbage.write_bytes(b"RIFF" + bytes(1000))
    proc = cadence("transcribe", str(speech["fox"]), str(garbage), str(speech["report"]), "--format", "json",
                   check_rc=1)
    results = json.loads(proc.stdout)
    assert [r["file"] for r in results] == [str(speech["fox"]), str(garbage), str(speech["report"])]
    good, bad, good2 = results
    assert set(good) >= {"file", "text", "language", "segments", "stats"}
    assert good["language"] == "en" and "fox" in good["text"].lower()
    assert {"start", "end", "text"} == set(good["segments"][0])
    assert {"tokens", "seconds", "tok_s"} <= set(good["stats"]) and good["stats"]["tokens"] > 0
    assert set(bad) == {"file", "error"} and bad["error"].endswith(".")
    assert "finance" in good2["text"].lower()


def test_transcribe_writes_files_and_refuses_to_overwrite(speech, tmp_path, tiny):
    out = tmp_path / "out"
    cadence("transcribe", str(speech["fox"]), "--format", "srt", "--out", str(out), check_rc=0)
    srt = (out / "fox.srt").read_text()
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and "fox" in srt.lower()
    again = cadence("transcribe", str(speech["fox"]), "--format", "srt", "--out", str(out), check_rc=1)
    assert "already exists" in again.stderr
    cadence("transcribe", str(speech["fox"]), "--format", "vtt", "--out", str(out), check_rc=0)
    assert (out / "fox.vtt").read_text().startswith("WEBVTT")


def test_chat_json_schema(smollm):
    proc = cadence("chat", "What is the capital of France?", "--max-tokens", "24", "--json", check_rc=0)
    result = json.loads(proc.stdout)
    assert set(result) == {"text", "tokens", "stats"}
    assert "Paris" in result["text"]
    assert all(isinstance(t, int) for t in result["tokens"])
    assert result["stats"]["tokens"] == len(result["tokens"])
    assert result["stats"]["tok_s"] > 0


def test_chat_streams_to_terminal(smollm):
    proc = cadence("chat", "Say hello.", "--max-tokens", "8", check_rc=0)
    assert proc.stdout.strip()
    assert "tok/s" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["chat", "hi", "--model", "no-such-model"], "Unknown model"),
        (["chat", "hi", "--temperature", "-1"], "Temperature"),
        (["transcribe", "x.wav", "--model", "smollm2-135m-instruct"], "not a speech-to-text"),
        (["chat", "hi", "--backend", "cuda"], "not available"),
    ],
)
def test_usage_errors_are_one_sentence(args, message):
    proc = cadence(*args, check_rc=2)
    assert message in proc.stderr
