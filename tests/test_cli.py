"""The ``cadence`` console script, run as a user runs it, and its documented output schema.

``transcribe`` and ``chat`` run on the batched engine; each subprocess loads its models, so the
model-running commands are kept few and their outputs shared through module fixtures.
"""

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys

import pytest

PROMPTS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "List the numbers from one to ten, one per line.",
]


def cadence(*args, check_rc=None, stdin=None, data_dir=None):
    env = None if data_dir is None else dict(os.environ, CADENCE_DATA_DIR=str(data_dir))
    proc = subprocess.run([sys.executable, "-m", "app.cli", *args], check=False, capture_output=True, text=True,
                          timeout=600, input=stdin, env=env)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def test_models_json():
    rows = json.loads(cadence("models", "--json", check_rc=0).stdout)
    from engine.whisper.sizes import SIZES

    assert {r["name"] for r in rows} == {"whisper-tiny.en", "whisper-base", "smollm2-135m-instruct", *SIZES}
    for r in rows:
        assert {"name", "family", "source", "available", "size", "present"} <= set(r)
        assert r["available"] is True or r["name"] in SIZES


# ---------------------------------------------------------------- transcribe
BATCHED = ("fox", "report", "budget")  # compared with --batch off, in input order


@pytest.fixture(scope="module")
def batched_run(speech, tmp_path_factory, tiny):
    """One process transcribing, at width 4, three short clips, a damaged file and the long clip (two
    windows): its JSON serves the schema, partial-failure, batched-equals-serial and timed-phrases
    tests, which each used to start a process (about 7 CPU s of imports and loading apiece) of their own."""
    garbage = tmp_path_factory.mktemp("garbage") / "noise.wav"
    garbage.write_bytes(b"RIFF" + bytes(1000))
    files = [str(speech["fox"]), str(garbage), str(speech["report"]), str(speech["budget"]), str(speech["long"])]
    proc = cadence("transcribe", *files, "--json", "--batch", "4", check_rc=1)
    results = json.loads(proc.stdout)
    assert [r["file"] for r in results] == files  # in input order
    return dict(zip(["fox", "garbage", "report", "budget", "long"], results))


def test_transcribe_json_schema_and_partial_failure(batched_run):
    good, bad, good2 = batched_run["fox"], batched_run["garbage"], batched_run["report"]
    assert set(good) >= {"file", "text", "language", "segments", "stats", "model", "job"}
    assert good["language"] == "en" and "fox" in good["text"].lower()
    assert good["model"] == "whisper-tiny.en"
    assert {"start", "end", "text"} == set(good["segments"][0])
    assert {"tokens", "seconds", "tok_s"} <= set(good["stats"]) and good["stats"]["tokens"] > 0
    assert set(bad) == {"file", "job", "error"} and bad["error"].endswith(".")
    assert "finance" in good2["text"].lower()


def test_transcribe_times_phrases_unless_told_not_to(speech, batched_run):
    timed = batched_run["long"]
    [windows] = json.loads(cadence("transcribe", str(speech["long"]), "--json", "--no-timestamps", check_rc=0).stdout)
    spans = [s["end"] - s["start"] for s in timed["segments"]]
    assert len(spans) >= 6 and max(spans) < 15.0  # phrases of a few seconds (about 45 s of speech)
    assert len(windows["segments"]) == 2  # one segment per window, as faster-whisper's without_timestamps
    assert "finance" in timed["text"].lower() and "finance" in windows["text"].lower()


def test_transcribe_batched_equals_batch_off_in_input_order(speech, batched_run):
    batched = [batched_run[n] for n in BATCHED]
    for result, word in zip(batched, ("fox", "report", "week")):
        assert word in result["text"].lower(), result["text"]
    files = [str(speech[n]) for n in BATCHED]
    serial = json.loads(cadence("transcribe", *files, "--json", "--batch", "off", check_rc=0).stdout)
    assert [r["file"] for r in serial] == files
    # Segments carry no token ids in the JSON, so compare what does: texts, segments and token counts.
    for b, s in zip(batched, serial):
        assert b["text"] == s["text"]
        assert [seg["text"] for seg in b["segments"]] == [seg["text"] for seg in s["segments"]]
        assert b["stats"]["tokens"] == s["stats"]["tokens"]


def test_transcribe_bad_files_do_not_stop_the_others(speech, tmp_path, tiny):
    garbage = tmp_path / "noise.wav"
    garbage.write_bytes(b"RIFF" + bytes(1000))
    missing = tmp_path / "missing.wav"
    out = tmp_path / "out"
    proc = cadence("transcribe", str(garbage), str(speech["fox"]), str(missing), str(speech["report"]),
                   "--out", str(out), "--batch", "4", check_rc=1)
    assert "fox" in (out / "fox.txt").read_text().lower()
    assert "report" in (out / "report.txt").read_text().lower()
    assert sorted(p.name for p in out.iterdir()) == ["fox.txt", "report.txt"]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(str(tmp_path))]
    assert any("noise.wav" in line and line.endswith(".") for line in errors), proc.stderr
    assert any("missing.wav" in line and "does not exist" in line for line in errors), proc.stderr
    assert proc.stdout == ""


def test_transcribe_writes_files_and_refuses_to_overwrite(speech, tmp_path, tiny):
    out = tmp_path / "out"
    cadence("transcribe", str(speech["fox"]), "--format", "srt", "--out", str(out), check_rc=0)
    srt = (out / "fox.srt").read_text()
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and "fox" in srt.lower()
    again = cadence("transcribe", str(speech["fox"]), "--format", "srt", "--out", str(out), check_rc=1)
    assert "already exists" in again.stderr
    assert (out / "fox.srt").read_text() == srt
    cadence("transcribe", str(speech["fox"]), "--format", "vtt", "--out", str(out), check_rc=0)
    assert (out / "fox.vtt").read_text().startswith("WEBVTT")


def test_an_existing_output_is_refused_before_an_engine_starts(speech, tmp_path, monkeypatch, capsys):
    """Nothing to decode: the refusal is one sentence, the file is kept, and no engine (models, calibration) starts."""
    import engine

    from app.cli import main as cli_main

    out = tmp_path / "out"
    out.mkdir()
    (out / "fox.txt").write_text("kept")

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a file whose output already exists")

    monkeypatch.setattr(engine, "Engine", no_engine)
    assert cli_main(["transcribe", str(speech["fox"]), "--out", str(out)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"{speech['fox']}: {out / 'fox.txt'} already exists (use --overwrite to replace it)."
    assert lines[-1].startswith("0 of 1 file transcribed")
    assert (out / "fox.txt").read_text() == "kept"


# ---------------------------------------------------------------- chat
@pytest.fixture(scope="module")
def serial_answers(smollm):
    """Each prompt alone, greedy, on the exact single-stream path: from a prompts file, which one slot
    answers one after another."""
    proc = cadence("chat", "--prompts", "-", "--json", "--max-tokens", "12", "--batch", "off", check_rc=0,
                   stdin="\n".join(PROMPTS) + "\n")
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def stopped_answer(smollm):
    """A PROMPT's answer (one JSON object), ended by a stop string."""
    proc = cadence("chat", PROMPTS[2], "--json", "--max-tokens", "24", "--stop", "3.", "--stop", "ten", check_rc=0)
    return json.loads(proc.stdout)


CHAT_KEYS = {"conversation_id", "user_message_id", "message_id", "text", "tokens", "finish_reason", "stats"}


def test_chat_json_schema(serial_answers, stopped_answer):
    assert isinstance(stopped_answer, dict) and isinstance(serial_answers, list)
    for result in [stopped_answer, *serial_answers]:  # a PROMPT's object, and each of a prompts file's list
        assert set(result) == CHAT_KEYS
        assert result["finish_reason"] in ("stop", "length")
        assert all(isinstance(t, int) for t in result["tokens"])
        stats = result["stats"]
        assert {"prompt_tokens", "tokens", "seconds", "time_to_first_token", "tok_s", "model", "finish_reason",
                "dropped_turns"} <= set(stats)
        assert stats["dropped_turns"] == 0
        assert stats["tokens"] == len(result["tokens"]) and stats["tok_s"] > 0
        assert stats["model"] == "smollm2-135m-instruct" and stats["finish_reason"] == result["finish_reason"]
    assert "Paris" in serial_answers[0]["text"]


def test_chat_prompts_file_equals_each_prompt_alone(serial_answers, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([PROMPTS[0], "", PROMPTS[1], "   ", PROMPTS[2]]) + "\n")
    proc = cadence("chat", "--prompts", str(prompts), "--json", "--max-tokens", "12", "--batch", "4", check_rc=0)
    answers = json.loads(proc.stdout)
    assert isinstance(answers, list) and len(answers) == len(PROMPTS)
    assert len({a["conversation_id"] for a in answers}) == len(PROMPTS)  # each prompt a conversation of its own
    for batched, alone in zip(answers, serial_answers):
        assert set(batched) == CHAT_KEYS
        assert batched["tokens"] == alone["tokens"]
        assert batched["text"] == alone["text"]
        assert batched["finish_reason"] == alone["finish_reason"]
    assert "Paris" in answers[0]["text"]


def test_chat_stop_string_ends_the_answer(serial_answers, stopped_answer):
    result = stopped_answer
    assert result["finish_reason"] == "stop" and result["stats"]["finish_reason"] == "stop"
    assert "2." in result["text"] and "3." not in result["text"]
    assert serial_answers[2]["text"].startswith(result["text"])  # the same answer, cut before "3."


def test_chat_streams_answers_with_headers_from_stdin(serial_answers):
    stdin = f"{PROMPTS[0]}\n{PROMPTS[2]}\n"
    proc = cadence("chat", "--prompts", "-", "--max-tokens", "16", "--stop", "3.", stdin=stdin, check_rc=0)
    first, second = proc.stdout.split("### Prompt 2\n")
    assert first.startswith("### Prompt 1\n") and "Paris" in first and first.endswith("\n\n")
    answer = second.rstrip("\n")
    # A streamed answer never shows its stop string, not even the start of it ("3").
    assert "2." in answer and not answer.endswith("3") and "3." not in answer
    assert serial_answers[2]["text"].startswith(answer)
    assert "tok/s" in proc.stderr and "2 of 2 prompts answered" in proc.stderr


def test_ctrl_c_cancels_and_exits_130(smollm, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "chat", "Write a long story about a dragon.",
                             "--max-tokens", "2000", "--batch", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, CADENCE_DATA_DIR=str(tmp_path)),
                            # As from a terminal: a suite started in the background (`make test &`) passes
                            # its children an ignored SIGINT, and Ctrl-C would then never reach the CLI.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        shown = proc.stdout.read(1)  # the answer has started streaming
        assert shown
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    # The answer so far is kept, marked as stopped by the user.
    db = sqlite3.connect(tmp_path / "cadence.sqlite3")
    answers = db.execute("SELECT content, state FROM messages WHERE role = 'assistant'").fetchall()
    db.close()
    [(content, state)] = answers
    assert state == "stopped" and content.startswith((shown + stdout).rstrip("\n"))


def _rows(data_dir):
    """Every row of the conversation tables in the store under data_dir."""
    db = sqlite3.connect(data_dir / "cadence.sqlite3")
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY id").fetchall() for t in ("conversations", "messages")}
    finally:
        db.close()


def test_chat_streams_to_terminal_is_stored_continued_listed_and_exported(tmp_path, smollm):
    first = json.loads(cadence("chat", "My name is Ada.", "--json", "--max-tokens", "8", "--system", "Be brief.",
                               data_dir=tmp_path, check_rc=0).stdout)
    cid = first["conversation_id"]
    proc = cadence("chat", "What is my name?", "--conversation", str(cid), "--max-tokens", "6", "--top-k", "3",
                   data_dir=tmp_path, check_rc=0)
    streamed = proc.stdout.rstrip("\n")
    # A PROMPT without --json streams its answer to the terminal, without headers, speed on stderr; and stored.
    assert streamed and "###" not in proc.stdout and "tok/s" in proc.stderr
    rows = json.loads(cadence("chat", "--list", "--json", data_dir=tmp_path, check_rc=0).stdout)
    assert [(r["id"], r["title"], r["model"], r["messages"]) for r in rows] == [
        (cid, "My name is Ada.", "smollm2-135m-instruct", 4)]
    table = cadence("chat", "--list", data_dir=tmp_path, check_rc=0).stdout.splitlines()
    assert table[0].split() == ["ID", "UPDATED", "MSGS", "MODEL", "TITLE"]
    assert table[1].split()[0] == str(cid) and table[1].endswith("My name is Ada.")

    data = json.loads(cadence("chat", "--export", str(cid), "--format", "json", data_dir=tmp_path, check_rc=0).stdout)
    assert [(m["role"], m["content"]) for m in data["messages"]] == [
        ("user", "My name is Ada."), ("assistant", first["text"]), ("user", "What is my name?"), ("assistant", streamed)]
    assert data["messages"][1]["id"] == first["message_id"] and data["messages"][0]["id"] == first["user_message_id"]
    assert data["system"] == "Be brief." and data["params"]["top_k"] == 3  # flags given change the settings
    assert data["params"]["max_tokens"] == 6 and all(m["state"] == "complete" for m in data["messages"])
    md = cadence("chat", "--export", str(cid), data_dir=tmp_path, check_rc=0).stdout
    assert md.startswith("# My name is Ada.") and "## You\n\nWhat is my name?" in md and streamed in md


def test_chat_bad_input_is_one_sentence_and_stores_nothing(tmp_path, smollm):
    # In a prompts file a bad prompt fails alone (status 1); the other is answered and stored. (Into an empty
    # store: it makes the conversation 1 that the cases below refer to.)
    proc = cadence("chat", "--prompts", "-", "--json", "--max-tokens", "2", stdin="x" * 2**20 + "\nSay hi.\n",
                   data_dir=tmp_path, check_rc=1)
    bad, good = json.loads(proc.stdout)
    assert bad == {"error": "The message is 1,048,576 characters long; a message can have at most 100,000."}
    assert set(good) == CHAT_KEYS
    before = _rows(tmp_path)
    assert [row[0] for row in before["conversations"]] == [good["conversation_id"]] == [1]
    assert len(before["messages"]) == 2  # the good prompt and its answer; nothing of the bad one
    for args, words in [
        (["chat", "hi", "--conversation", "99"], "There is no conversation 99."),
        (["chat", ""], "The message is empty."),
        (["chat", "x" * 110_000], "at most 100,000"),
        (["chat", "hi", "--conversation", "1", "--top-p", "1.5"], "top-p"),
        (["chat", "hi", "--conversation", "1", "--temperature", "-1"], "Temperature"),
        (["chat", "--export", "99"], "There is no conversation 99."),
        (["chat", "--list", "hi"], "--list"),
        (["chat", "hi", "--format", "md"], "--format goes with --export"),
        (["chat", "--prompts", "-", "--conversation", "1"], "--conversation"),
    ]:
        proc = cadence(*args, data_dir=tmp_path, check_rc=2)
        assert words in proc.stderr and proc.stderr.strip().count("\n") == 0 and proc.stdout == "", args
    # Too many tokens for the context, though not too many characters: the request fails, nothing is kept.
    # The context is pinned: "auto" gives the model's own (8192 here) whenever memory allows, which this fits.
    long = "The quick brown fox jumps over the lazy dog near the quiet river bank. " * 220
    proc = cadence("chat", long, "--conversation", "1", "--context", "2048", data_dir=tmp_path, check_rc=1)
    budget = re.search(r"tokens, more than the (\d+) this model takes", proc.stderr)
    assert budget and int(budget.group(1)) < 2048 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert _rows(tmp_path) == before


# ---------------------------------------------------------------- usage errors
@pytest.mark.parametrize(
    "args, message",
    [
        (["chat", "hi", "--model", "no-such-model"], "Unknown model"),
        (["chat", "hi", "--temperature", "-1"], "Temperature"),
        (["chat", "hi", "--min-p", "2"], "min-p"),
        (["chat", "hi", "--presence-penalty", "3"], "presence penalty"),
        (["transcribe", "x.wav", "--model", "smollm2-135m-instruct"], "not a speech-to-text"),
        (["chat", "hi", "--backend", "cuda"], "not available"),
        (["chat", "hi", "--batch", "0"], "--batch"),
        (["transcribe", "x.wav", "--batch", "abc"], "--batch"),
        (["chat", "hi", "--batch", "-1"], "--batch"),
        (["chat", "hi", "--context", "10"], "--context: Context must be at least 64 tokens"),
        (["transcribe", "x.wav", "--context", "long"], "--context"),
        (["chat"], "Give a PROMPT"),
        (["transcribe", "x.wav", "--json", "--format", "srt"], "--json"),
    ],
)
def test_usage_errors_are_one_sentence(args, message):
    proc = cadence(*args, check_rc=2)
    assert message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.strip().endswith(".")
    assert proc.stdout == ""


def test_prompts_usage_errors(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    both = cadence("chat", "hi", "--prompts", str(prompts), check_rc=2)
    assert "not both" in both.stderr
    prompts.write_text("\n  \n")
    empty = cadence("chat", "--prompts", str(prompts), check_rc=2)
    assert "holds no prompts" in empty.stderr
