"""The app on a server's engine (issue 17): Settings' "Engine: a server" with `cadence serve` running in a process
of its own, the real window offscreen and the real store. Chats, a 2-file transcription, the transcript viewer and
exports go through the server and equal what it answers; a server killed mid-answer leaves the partial answer stored
and marked failed; *Test connection* answers in one sentence; the engine panel draws the server's /slots and
/metrics live without blocking the window."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time

import pytest
from PySide6.QtCore import Qt
from serving import start_server, status
from app_support import (app_home, chat_equals_servers_answer, drop_files, open_window, row_texts,  # noqa: F401
                         short_params, wait_answers, wait_jobs_settled)

# The tests never touch a person's keyring: keyring's own setting names the backend that has none (as on CI),
# so the key is kept for the session only, which is what the panel must then say.
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.fail.Keyring"

KEY = "remote-app-key"
CHAT = "smollm2-135m-instruct"
WHISPER = "whisper-tiny.en"
FREEZE_S = 1.0  # a window that does not answer for this long is frozen


def _health(url: str) -> int:
    return status(url + "/health")


def _start_server(tmp_path_factory, *flags):
    return start_server(tmp_path_factory, KEY, "--precision", "float32", "--batch", "4", "--context", "2048", *flags)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url, lines = _start_server(tmp_path_factory)
    yield url
    proc.terminate()
    proc.wait(30)
    assert "Traceback" not in "".join(lines)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=600)


def _server_window(qtbot, app_home, url, **values):  # noqa: F811
    window = open_window(qtbot, app_home(engine_mode="server", server_url=url, api_key=KEY, **values))
    assert window.bridge.remote and window.bridge.engine.url == url + "/v1"
    return window


def _dead_url() -> str:
    """A loopback address nothing listens on (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _one_sentence(text: str) -> bool:
    return text.endswith(".") and "Traceback" not in text and "\n" not in text


# ---------------------------------------------------------------------------- chats and transcriptions
def test_settings_switch_to_a_server_and_chats_transcripts_and_exports_equal_its_answers(
        qtbot, app_home, server, client, speech, tmp_path):  # noqa: F811
    home = app_home(output_folder=str(tmp_path / "out"), output_formats=["txt", "srt"])
    window = open_window(qtbot, home)
    assert not window.bridge.remote
    panel = window.settings_panel
    assert not panel.server.url.isEnabled() and panel.engine_box.isEnabled()

    # Settings: "a server", its address and key, Apply: the engine is the server's from now on.
    panel.server.mode.setCurrentIndex(panel.server.mode.findData("server"))
    assert panel.server.url.isEnabled() and not panel.engine_box.isEnabled()  # engine-only settings greyed out
    assert not panel.speakers.isEnabled() and "set where it runs" in panel.server.note.text()
    panel.server.url.setText(server.removeprefix("http://"))  # host:port is enough
    panel.server.key.setText(KEY)
    note = panel.apply()
    assert "are in use" in note, note
    assert window.bridge.remote and window.bridge.engine.url == server + "/v1"
    # No keyring works here: the key is kept for this session only, the panel says so, and the settings file
    # never holds it.
    assert "this session only" in panel.server.key_note.text() and _one_sentence(panel.server.key_note.text())
    settings_file = home.q.fileName()
    home.q.sync()
    assert KEY not in open(settings_file, encoding="utf-8").read()
    assert app_home().engine_mode == "server" and app_home().api_key == KEY  # (the session's key)
    # The connection test Apply started fills the model choices with the server's names.
    qtbot.waitUntil(lambda: panel.server.tests >= 1, timeout=30000)
    assert panel.server.result.text().startswith("Reachable") and CHAT in panel.server.result.text()
    assert [panel.chat_model.itemText(i) for i in range(panel.chat_model.count())] == [CHAT]
    assert [panel.transcription_model.itemText(i) for i in range(panel.transcription_model.count())] == [WHISPER]
    from app.chat_settings import ChatSettingsDialog
    from app.remote_settings import listed_chat_models

    assert listed_chat_models(window.bridge) == [CHAT]  # what a chat's own settings offer on this server
    chats_dialog = ChatSettingsDialog(window.bridge.conversations.get(window.chats.new_chat()), window,
                                      models=listed_chat_models(window.bridge))
    assert [chats_dialog.model.itemText(i) for i in range(chats_dialog.model.count())] == [CHAT]
    chats_dialog.deleteLater()
    # Recording needs this computer's engine, said in one sentence where the app records.
    window.recording.record()
    assert "needs the engine on this computer" in window.recording.message.text()
    assert window.recording.recorder.state == "idle" and not window.recording.record_button.isEnabled()

    # A chat: streamed through the server, stored, shown; its text is the server's own greedy answer.
    chats = window.chats
    answer, want = chat_equals_servers_answer(qtbot, window, client, CHAT, "What is the capital of France?", 24)
    assert answer.stats["tokens"] == want.usage.completion_tokens and answer.stats["server"] == server + "/v1"
    shown = chats.rendered_text()
    assert "Paris" in shown and "tok/s" in shown and "writing" not in shown
    exported = chats.export_to(tmp_path / "chat.md")  # Export… as Markdown, as for a chat answered here
    assert exported is not None and answer.content.strip() in exported.read_text(encoding="utf-8")

    # Two files dropped on the queue: each a job in the store, transcribed by the server, saved, viewable.
    drop_files(window.queue, [speech["fox"], speech["report"]])
    assert window.queue.table.rowCount() == 2
    wait_jobs_settled(qtbot, window, timeout=300)
    jobs = {os.path.basename(j.path): j for j in window.bridge.jobs.list()}
    assert {name: j.state for name, j in jobs.items()} == {"fox.wav": "done", "report.wav": "done"}, \
        {name: j.error for name, j in jobs.items()}
    for name in ("fox", "report"):
        with open(speech[name], "rb") as f:
            theirs = client.audio.transcriptions.create(model=WHISPER, file=f, response_format="verbose_json",
                                                        timestamp_granularities=["segment"])
        mine = jobs[f"{name}.wav"].result
        assert mine["text"] == theirs.text.strip() and mine["model"] == WHISPER
        assert [s["text"] for s in mine["segments"]] == [s.text.strip() for s in theirs.segments]
        saved = (tmp_path / "out" / f"{name}.txt").read_text(encoding="utf-8").split()  # (a line per segment)
        assert saved == theirs.text.split()
        assert "-->" in (tmp_path / "out" / f"{name}.srt").read_text(encoding="utf-8")
    assert "lazy dog" in jobs["fox.wav"].result["text"].lower()

    # The transcript viewer shows it and exports it, as for a transcript made here.
    window.open_transcript(jobs["fox.wav"].id)
    view = window.transcript
    assert view.job_id == jobs["fox.wav"].id
    assert [view.table.item(r, 2).text() for r in range(view.table.rowCount())] == \
        [s["text"] for s in jobs["fox.wav"].result["segments"]]
    assert view.export_to(tmp_path / "fox.json") is not None
    assert json.loads((tmp_path / "fox.json").read_text())["text"] == jobs["fox.wav"].result["text"]

    # Chat about this transcript: the question is answered by the server with the transcript in its context.
    window.chat_about(jobs["fox.wav"].id)
    about = chats.current
    assert chats.apply_settings(params=short_params(12))
    assert chats.send("Who jumps over the dog?"), chats.error.text()
    wait_answers(qtbot, window, timeout=300)
    conv = window.bridge.conversations.get(about)
    assert conv.messages[-1].state == "complete" and conv.messages[-1].content.strip()
    assert "lazy dog" in conv.system.lower()

    # Back to this computer: its engine again, its settings and model names back.
    window.tabs.setCurrentWidget(panel)
    panel.server.mode.setCurrentIndex(panel.server.mode.findData("local"))
    assert panel.engine_box.isEnabled() and panel.speakers.isEnabled()
    assert "are in use" in panel.apply() and not window.bridge.remote and app_home().engine_mode == "local"
    assert CHAT in [panel.chat_model.itemText(i) for i in range(panel.chat_model.count())]
    assert panel.transcription_model.count() > 1  # this computer's Whisper models, not the server's one


# ---------------------------------------------------------------------------- Test connection
def test_test_connection_answers_in_one_sentence_without_blocking_the_window(qtbot, app_home, server):  # noqa: F811
    from app.heartbeat import Heartbeat

    window = open_window(qtbot, app_home())
    box = window.settings_panel.server
    box.mode.setCurrentIndex(box.mode.findData("server"))
    beat = Heartbeat()
    beat.start()
    cases = [(server, KEY, r"^Reachable: the server at .* lists 2 models \(.*smollm2-135m-instruct.*whisper-tiny\.en"),
             (server, "wrong-key", r"refused the API key"),
             (_dead_url(), KEY, r"could not be reached"),
             ("ftp://example", KEY, r"is not an http:// or https:// address"),
             ("", KEY, r"Give the server's address")]
    for url, key, pattern in cases:
        answered = box.tests
        box.url.setText(url)
        box.key.setText(key)
        qtbot.mouseClick(box.test_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: box.tests > answered, timeout=60000)
        sentence = box.result.text()
        assert re.search(pattern, sentence), (url, sentence)
        assert _one_sentence(sentence), sentence
    beat.stop()
    assert beat.longest < FREEZE_S, f"the window was blocked for {beat.longest:.2f} s"
    assert not window.bridge.remote  # testing changes nothing until Apply

    # Apply with a bad address: nothing changes, and the sentence says why.
    box.url.setText("ftp://example")
    note = window.settings_panel.apply()
    assert not window.bridge.remote and "not an http:// or https:// address" in note


# ---------------------------------------------------------------------------- the engine panel
def test_the_engine_panel_draws_the_servers_slots_and_metrics_live(qtbot, app_home, server, client):  # noqa: F811
    from app.heartbeat import Heartbeat

    window = _server_window(qtbot, app_home, server)
    panel = window.engine_panel
    qtbot.wait(1500)
    assert window.remote_poller.polls == 0 and panel.samples == 0  # the server is asked only while the panel shows
    window.remote_poller.interval = 0.25  # (a short answer is watched closely)
    window.tabs.setCurrentWidget(panel)
    # RemoteEngine reads them itself: llama.cpp's slots shape, the Prometheus text parsed.
    slots, metrics = window.bridge.engine.slots(), window.bridge.engine.metrics()
    assert slots and {"id", "is_processing", "id_task", "n_ctx", "next_token"} <= set(slots[0])
    assert ({"model_name": CHAT}, 4.0) in metrics["cadence:lane_width"]
    before = sum(v for labels, v in metrics.get("cadence:generation_tokens_total", []) if labels["model_name"] == CHAT)

    beat = Heartbeat()
    beat.start()
    chats = window.chats
    conversation_id = chats.new_chat()
    assert chats.apply_settings(params=short_params(100))  # long enough to watch, short enough to wait for
    assert chats.send("Write a long story about a dragon who learns to bake bread."), chats.error.text()

    def busy_row():
        table = panel.slots_table
        for r in range(table.rowCount()):
            if table.item(r, 6) and table.item(r, 6).text() == "decoding" and int(table.item(r, 2).text() or 0) > 3:
                return r
        return None

    qtbot.waitUntil(lambda: panel.lane_name == CHAT and busy_row() is not None, timeout=120000)
    row = busy_row()
    assert panel.slots_table.item(row, 1).text().startswith("server request ")
    assert panel.slots_table.item(row, 3).text() == "2048"  # the slot's context, as the server reports it
    assert panel.slots_table.rowCount() == 4  # the lane's 4 slots
    qtbot.waitUntil(lambda: "1 request running" in panel.summary.text(), timeout=30000)
    assert "a Cadence server" in panel.summary.text()
    assert "1/4 slots busy" in panel.lane_info.text() and "step time not reported" in panel.lane_info.text()
    assert panel.server_info.isVisible()
    assert panel.server_info.text() == "This server does not report step time, calibration or precision."
    assert panel.calibration_drawn["note"] == "Not reported by the server"
    qtbot.waitUntil(lambda: max(panel.slot_bar_heights() or [0]) > 0, timeout=30000)  # tokens/s of the busy slot
    polls = window.remote_poller.polls

    wait_answers(qtbot, window, timeout=300)
    stored = window.bridge.conversations.get(conversation_id).messages[-1]
    assert stored.state == "complete" and stored.content
    # The answer's tokens reach the server's counters, and the panel shows them; its slot is free again.
    qtbot.waitUntil(lambda: busy_row() is None and "0 requests running" in panel.summary.text(), timeout=30000)
    after = sum(v for labels, v in window.bridge.engine.metrics()["cadence:generation_tokens_total"]
                if labels["model_name"] == CHAT)
    assert after - before == stored.stats["tokens"]
    qtbot.waitUntil(lambda: f"{after:.0f} tokens generated" in panel.summary.text(), timeout=30000)
    beat.stop()
    assert window.remote_poller.polls > polls  # it polled all along
    assert beat.longest < FREEZE_S, f"the window was blocked for {beat.longest:.2f} s"


def test_stop_keeps_a_servers_answer_as_stopped(qtbot, app_home, server):  # noqa: F811
    window = _server_window(qtbot, app_home, server)
    chats = window.chats
    conversation_id = chats.new_chat()
    assert chats.apply_settings(params=short_params(400))
    assert chats.send("Write a long story about a dragon who learns to bake bread."), chats.error.text()
    qtbot.waitUntil(lambda: len(getattr(window.bridge.answering(conversation_id), "reply", None).text) > 20
                    if window.bridge.answering(conversation_id) else False, timeout=120000)
    chats.stop_button.click()
    wait_answers(qtbot, window, timeout=60)
    stored = window.bridge.conversations.get(conversation_id).messages[-1]
    assert stored.content and stored.state == "stopped", (stored.state, stored.error)


# ---------------------------------------------------------------------------- a server that dies
def test_a_server_killed_mid_answer_leaves_the_partial_answer_stored_and_marked(qtbot, app_home, tmp_path_factory,  # noqa: F811
                                                                              speech, caplog):
    """...and a file queued once the server is gone is tried again by the client, then fails with one sentence,
    shown in its row."""
    proc, url, _ = _start_server(tmp_path_factory, "--whisper-model", "none")
    try:
        window = _server_window(qtbot, app_home, url)
        chats = window.chats
        conversation_id = chats.new_chat()
        assert chats.apply_settings(params=short_params(2000))
        assert chats.send("Write a long story about a lighthouse keeper."), chats.error.text()
        qtbot.waitUntil(lambda: window.bridge.answering(conversation_id) is not None
                        and len(window.bridge.answering(conversation_id).reply.text) > 40, timeout=120000)
        proc.kill()  # SIGKILL: the server dies mid-answer
        proc.wait(30)
        wait_answers(qtbot, window, timeout=120)
        answer = window.bridge.conversations.get(conversation_id).messages[-1]
        assert answer.state == "failed" and len(answer.content) > 40
        assert re.search("connection to it was lost|ended before the answer did", answer.error), answer.error
        assert _one_sentence(answer.error)
        shown = chats.rendered_text()
        assert answer.content[:40] in shown and answer.error in shown
        # Read from the store by another reader (as the next start does), the partial answer is there, marked failed.
        from engine.chat.answering import Conversations

        again = Conversations().get(conversation_id).messages[-1]
        assert again.content == answer.content and again.state == "failed"
        # The engine panel says the server cannot be reached any more, in one sentence.
        window.tabs.setCurrentWidget(window.engine_panel)
        qtbot.waitUntil(lambda: "could not be reached" in window.engine_panel.server_info.text(), timeout=30000)
        assert _one_sentence(window.engine_panel.server_info.text())

        # A file dropped on the queue now: its upload is tried again as often as the client retries (RETRIES), then
        # the job fails with one sentence, and its row shows that sentence.
        from app.queue_view import FILE, MESSAGE, STATE
        from engine.remote import RETRIES

        caplog.clear()
        caplog.set_level(logging.INFO, logger="openai")
        window.tabs.setCurrentIndex(0)  # Transcribe
        drop_files(window.queue, [speech["fox"]])
        wait_jobs_settled(qtbot, window, timeout=120)
        [job] = window.bridge.jobs.list()
        assert job.state == "failed" and "could not be reached" in job.error and _one_sentence(job.error), job
        retries = [r.getMessage() for r in caplog.records
                   if r.threadName.startswith("cadence-remote") and r.getMessage().startswith("Retrying request in ")]
        assert [m.split("(")[-1] for m in retries] == [f"retry {i} of {RETRIES})" for i in range(1, RETRIES + 1)]
        [row] = [r for r in row_texts(window.queue.table) if r[FILE] == "fox.wav"]
        assert row[STATE] == "Failed" and row[MESSAGE] == job.error, row
    finally:
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------------------- a server that reports less
def test_llama_cpp_python_server_chats_and_the_panel_says_what_it_does_not_report(qtbot, app_home):  # noqa: F811
    """llama-cpp-python's server (the registry's SmolLM2 GGUF) has neither /slots nor /metrics: the app chats through
    it all the same, and the engine panel says so in one sentence rather than drawing nothing."""
    import torch
    from openai import OpenAI

    from bench.servers import llama_cpp_server, smollm2_gguf

    with llama_cpp_server(smollm2_gguf(), threads=torch.get_num_threads(), alias="smollm2") as server:
        window = open_window(qtbot, app_home(engine_mode="server", server_url=server.url, chat_model="smollm2"))
        assert window.bridge.remote and window.bridge.engine.slots() is None and window.bridge.engine.metrics() is None
        window.tabs.setCurrentWidget(window.engine_panel)
        qtbot.waitUntil(lambda: window.engine_panel.server_info.text() == (
            "This server does not report step time, calibration, precision, its slots (it has no /slots) or its "
            "metrics (it has no /metrics)."), timeout=30000)
        direct = OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=300)
        chat_equals_servers_answer(qtbot, window, direct, "smollm2", "What is the capital of France?", 12)


def test_vllm_and_llama_cpp_metrics_are_read_by_their_own_names():
    """The panel reads vLLM's names (as vLLM 0.32 exports them: counters with _total, labels model_name and engine)
    and llama.cpp's (no model label), from Prometheus text parsed as RemoteEngine.metrics() parses it."""
    from prometheus_client.parser import text_string_to_metric_families

    from app.remote_status import remote_status

    def parsed(text):
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return out

    vllm = parsed('# TYPE vllm:num_requests_running gauge\n'
                  'vllm:num_requests_running{engine="0",model_name="smollm2"} 2\n'
                  'vllm:num_requests_running{engine="1",model_name="smollm2"} 1\n'
                  '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="smollm2"} 4\n'
                  '# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{engine="0",model_name="smollm2"} 120\n'
                  '# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine="0",model_name="smollm2"} 40\n'
                  '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25\n'
                  '# TYPE vllm:time_to_first_token_seconds histogram\n'
                  'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smollm2"} 2\n'
                  'vllm:time_to_first_token_seconds_count{engine="0",model_name="smollm2"} 2\n'
                  'vllm:time_to_first_token_seconds_sum{engine="0",model_name="smollm2"} 0.5\n')
    status = remote_status("http://gpu-box:8000/v1", None, vllm)
    assert status["remote"]["summary"] == ("Server: http://gpu-box:8000/v1 (vLLM) · 3 requests running, 4 waiting · "
                                           "120 tokens generated, 40 prompt tokens · means: first token 0.25 s · "
                                           "KV cache 25% used")
    assert status["remote"]["missing"] == ("This server does not report step time, calibration, precision or its "
                                           "slots (it has no /slots).")
    assert status["lanes"]["smollm2"]["running"] == 3 and status["lanes"]["smollm2"]["waiting"] == 4

    llama = parsed('# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 30\n'
                   '# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n'
                   '# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n')
    slots = [{"id": 0, "id_task": 5, "n_ctx": 4096, "is_processing": True, "next_token": {"n_decoded": 7}},
             {"id": 1, "id_task": -1, "n_ctx": 4096, "is_processing": False, "next_token": {"n_decoded": 0}}]
    status = remote_status("http://box:8080/v1", slots, llama)
    assert "(llama.cpp's server) · 1 request running, 0 waiting · 30 tokens generated" in status["remote"]["summary"]
    assert status["remote"]["missing"].endswith("precision, latencies or drafting.")
    [lane] = status["lanes"].values()
    assert lane["slots"] == [{"request": "server request 5", "context": 4096, "tokens": 7, "drafted": None,
                              "accepted": None}, None] and lane["width"] == 2
