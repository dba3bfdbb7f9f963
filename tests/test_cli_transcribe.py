"""``cadence transcribe`` as a user runs it: outputs next to the inputs, jobs in the store, and a
real kill in the middle of a file followed by ``--resume``."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from engine import TranscribeRequest


def run_cli(*args, env=None, check_rc=None):
    proc = subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=900,
                          env=env)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


@pytest.fixture
def private_store(tmp_path):
    env = dict(os.environ, CADENCE_DATA_DIR=str(tmp_path / "data"))
    return env, tmp_path / "data" / "cadence.sqlite3"


def test_outputs_go_next_to_the_inputs_by_default_and_to_stdout_with_out_dash(speech, tmp_path, private_store, tiny):
    env, _ = private_store
    clip = tmp_path / "meeting.wav"
    clip.write_bytes(speech["fox"].read_bytes())
    run_cli("transcribe", str(clip), "--format", "srt", env=env, check_rc=0)
    srt = (tmp_path / "meeting.srt").read_text()
    assert srt.startswith("1\n00:00:00,000 --> ") and "dog" in srt.lower()
    printed = run_cli("transcribe", str(clip), "--out", "-", env=env, check_rc=0).stdout
    assert "dog" in printed.lower() and not (tmp_path / "meeting.txt").exists()


def test_killed_mid_file_then_resumed_without_redoing_finished_windows(speech, tmp_path, private_store, tiny,
                                                                          engine4):
    env, db = private_store
    long_file = tmp_path / "lecture.wav"
    subprocess.run(["sox", str(speech["long"]), str(long_file), "repeat", "3"], check=True)  # 4 copies: 5 or 6 windows
    out = tmp_path / "out"
    args = ["transcribe", str(long_file), "--model", "whisper-tiny.en", "--format", "json", "--out", str(out),
            "--batch", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    recorded = 0
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if db.exists():
            with sqlite3.connect(db) as con:
                try:
                    recorded = con.execute("SELECT COUNT(*) FROM job_windows").fetchone()[0]
                except sqlite3.OperationalError:
                    recorded = 0
            if recorded >= 2:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the transcription finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with sqlite3.connect(db) as con:
        state, total = con.execute("SELECT state, windows_total FROM jobs").fetchone()
        kept = {i: d for i, d in con.execute("SELECT idx, data FROM job_windows")}
    assert state == "running" and total >= 4 and 2 <= len(kept) < total
    assert not (out / "lecture.json").exists()

    steps = tmp_path / "steps.jsonl"
    resumed = run_cli("transcribe", "--resume", env=dict(env, CADENCE_STEP_STATS=str(steps)), check_rc=0)
    assert "Resuming 1 unfinished job" in resumed.stderr
    result = json.loads((out / "lecture.json").read_text())
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT state FROM jobs").fetchone()[0] == "done"
        after = {i: d for i, d in con.execute("SELECT idx, data FROM job_windows")}
    assert all(after[i] == kept[i] for i in kept)  # finished windows were kept as they were
    # The resumed run decoded only the windows that were missing.
    decoded = sum(sum(json.loads(line)["tokens"].values()) for line in steps.read_text().splitlines())
    missing = sum(len(json.loads(after[i])["tokens"]) for i in after if i not in kept)
    assert decoded == missing
    # And the result is what an uninterrupted run gives: the suite's engine, in this process (a third
    # command-line process would only add its imports and loading to the same decoding).
    fresh = engine4.submit(TranscribeRequest(long_file, model="whisper-tiny.en", timestamps=True)).result(600)
    assert fresh.text == result["text"]
