"""`cadence serve`'s bounds, in a server of their own (two slots, at most two requests waiting, whisper-tiny.en):
beyond the queue limit a request is answered at once with 429 and Retry-After and none is lost, and clients that
honour Retry-After (the openai client, and RemoteEngine's transcriptions through it) get their answers once the line
drains; a transcription whose connection drops is sent again; a server started after one that died mid-transcription
fails that one's jobs and deletes their uploads (not a running server's); a server killed mid-answer leaves the
partial answer stored, marked failed."""

import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from serving import start_server, stop_server
from test_serve import KEY, MODEL, WHISPER, _post, _scrape

from engine import SamplingParams, TranscribeRequest

STOPPED = "The server stopped before this transcription finished."


@pytest.fixture(scope="module")
def left_behind(tmp_path_factory):
    """A data folder as servers left it: a server that died (its process gone) with one job queued and one mid-way,
    each with its upload; a server still running (this test process) with one job mid-way; one job long done."""
    from engine.jobs import JobStore

    data = tmp_path_factory.mktemp("small-serve-data")
    uploads = data / "server" / "uploads"
    uploads.mkdir(parents=True)
    jobs = JobStore(data / "server" / "jobs.sqlite")
    dead = _ended_pid()
    ids, folders = {}, {}
    for name, pid, state in (("queued", dead, "queued"), ("midway", dead, "running"),
                             ("alive", os.getpid(), "running"), ("done", dead, "done")):
        folders[name] = uploads / f"{name}-0123456789abcdef"  # (a server names them by a fresh uuid)
        ids[name] = jobs.create(folders[name] / f"{name}.wav", WHISPER,
                                {"format": "json", "task": "transcribe", "server_pid": pid})
        if state == "done":  # (its upload was deleted once it was answered)
            jobs.finished(ids[name], {"text": "Done long ago."})
            continue
        folders[name].mkdir()
        (folders[name] / f"{name}.wav").write_bytes(b"RIFF")
        if state == "running":
            jobs.started(ids[name], 2, "en", 40.0, spans=[[0, 3000], [3000, 1000]])
    return {"data": data, "ids": ids, "folders": folders}


def _ended_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, left_behind):
    """Two slots and at most two requests waiting, and whisper-tiny.en, on the data folder left behind: (URL,
    process)."""
    proc, url, lines = start_server(tmp_path_factory, KEY, "--precision", "float32", "--batch", "2",
                                    "--max-waiting", "2", "--whisper-model", WHISPER, data=left_behind["data"])
    yield url, proc
    stop_server(proc, lines)


def test_a_server_start_fails_a_dead_servers_jobs_and_deletes_their_uploads(small_server, left_behind):
    """The real server's start (on the data folder left behind): the dead server's queued and half-done jobs are
    failed with one sentence and their uploads deleted; the running server's job and upload, and the done job, are
    left as they were."""
    from engine.jobs import JobStore

    jobs = JobStore(left_behind["data"] / "server" / "jobs.sqlite")
    ids, folders = left_behind["ids"], left_behind["folders"]
    for name in ("queued", "midway"):
        job = jobs.get(ids[name])
        assert (job.state, job.error) == ("failed", STOPPED), (name, job)
        assert not folders[name].exists(), name
    alive = jobs.get(ids["alive"])
    assert alive.state == "running" and alive.error is None
    assert (folders["alive"] / "alive.wav").read_bytes() == b"RIFF"
    done = jobs.get(ids["done"])
    assert done.state == "done" and done.result == {"text": "Done long ago."}
    assert (left_behind["data"] / "server" / "uploads").is_dir()


def test_a_job_left_by_an_earlier_server_with_this_servers_process_id_is_recovered(tmp_path):
    """A server restarted in a container has the process id its predecessor had (often 1): a job that predecessor
    left unfinished names this very process, yet it cannot be this server's, which has only just started."""
    from app.server_audio import AudioService
    from engine.jobs import JobStore

    folder = tmp_path / "server"
    upload = folder / "uploads" / "0123456789abcdef" / "meeting.wav"
    upload.parent.mkdir(parents=True)
    upload.write_bytes(b"RIFF")
    jobs = JobStore(folder / "jobs.sqlite")
    job_id = jobs.create(upload, WHISPER, {"format": "json", "task": "transcribe", "server_pid": os.getpid()})
    jobs.started(job_id, 1, "en", 3.0, spans=[[0, 300]])
    # A job whose file lies outside the uploads (a damaged or hand-edited store) is failed, but its folder is
    # not the server's to delete.
    elsewhere = tmp_path / "someone-elses" / "notes.wav"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"RIFF")
    outside_id = jobs.create(elsewhere, WHISPER, {"format": "json", "task": "transcribe", "server_pid": os.getpid()})

    AudioService(None, [WHISPER], 1 << 20, folder)  # the audio part of a server starting on this folder

    job = jobs.get(job_id)
    assert (job.state, job.error) == ("failed", STOPPED)
    assert not upload.parent.exists() and (folder / "uploads").is_dir()
    assert jobs.get(outside_id).state == "failed" and elsewhere.exists()


def test_a_reused_process_id_is_not_taken_for_the_server_that_left_a_job_and_orphan_uploads_are_swept(tmp_path):
    """A job's server is known by its process id and start time: a job whose mark names a running process (this
    one) that started at another time was queued by an earlier server that had the id, and is failed; one whose
    mark is this process's own is left alone. Upload folders that no job names are removed once an hour old
    (a server stopped between saving and queueing), a newer one is kept (a running server may be writing it)."""
    from app.server_audio import ORPHAN_UPLOAD_S, AudioService
    from engine.jobs import JobStore
    from engine.processes import process_mark

    folder = tmp_path / "server"
    uploads = folder / "uploads"
    uploads.mkdir(parents=True)
    jobs = JobStore(folder / "jobs.sqlite")
    pid, started = process_mark().split(":")
    ids = {}
    for name, mark in (("reused", f"{pid}:{float(started) - 60:.3f}"), ("running", process_mark())):
        (uploads / name).mkdir()
        (uploads / name / "talk.wav").write_bytes(b"RIFF")
        ids[name] = jobs.create(uploads / name / "talk.wav", WHISPER, {"format": "json", "task": "transcribe",
                                                                        "server": mark})
    for name, age in (("orphan-old", ORPHAN_UPLOAD_S + 60), ("orphan-new", 60)):
        (uploads / name).mkdir()
        (uploads / name / "talk.wav").write_bytes(b"RIFF")
        then = time.time() - age
        os.utime(uploads / name, (then, then))
    old_running = time.time() - ORPHAN_UPLOAD_S - 60  # a running server's job, its upload older than an hour
    os.utime(uploads / "running", (old_running, old_running))

    AudioService(None, [WHISPER], 1 << 20, folder)

    assert (jobs.get(ids["reused"]).state, jobs.get(ids["reused"]).error) == ("failed", STOPPED)
    assert jobs.get(ids["running"]).state == "queued" and (uploads / "running" / "talk.wav").exists()
    assert sorted(p.name for p in uploads.iterdir()) == ["orphan-new", "running"]


def test_requests_beyond_the_queue_limit_are_turned_away_and_clients_that_wait_as_told_get_answers(
        small_server, speech, caplog):
    """Both slots busy and two requests waiting (the limit): each of 200 more is answered at once with 429 and
    Retry-After (whole seconds, from the running mean of request times); the openai client, and a transcription
    through RemoteEngine (its client's own retries), wait as Retry-After says and try again, and once the clients
    holding the four leave, both get the answers the server gives when asked directly."""
    from openai import OpenAI

    from engine.remote import RETRIES, RemoteEngine

    url, _ = small_server
    client = OpenAI(base_url=url + "/v1", api_key=KEY, timeout=600, max_retries=0)
    release, held = threading.Event(), []

    def hold():  # a story far longer than the test: it holds its slot (or its place in line) until released
        stream = client.chat.completions.create(model=MODEL, max_tokens=2000, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "Write a long story about a lighthouse."}])
        held.append(stream)
        release.wait(600)
        stream.close()

    holders = [threading.Thread(target=hold) for _ in range(4)]
    for t in holders:
        t.start()
    model = (("model_name", MODEL),)
    deadline = time.monotonic() + 300
    while True:
        metrics = _scrape(url)
        if (metrics.get(("cadence:num_requests_running", model)), metrics.get(("cadence:num_requests_waiting", model))) \
                == (2, 2):
            break
        assert time.monotonic() < deadline, "four long requests never filled two slots and the line"
        time.sleep(0.2)
    body = json.dumps({"model": MODEL, "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    outcomes = []

    def ask():
        request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                outcomes.append((r.status, r.read().decode(), None))
        except urllib.error.HTTPError as exc:
            outcomes.append((exc.code, json.loads(exc.read())["error"]["message"], exc.headers.get("Retry-After")))

    threads = [threading.Thread(target=ask) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(outcomes) == 200  # every request was answered
    assert [code for code, _, _ in outcomes] == [429] * 200, outcomes[:3]
    assert all("busy" in text and text.endswith(".") for _, text, _ in outcomes)
    # Retry-After is the running mean of how long a request took, in whole seconds and at least 1. No request has been
    # answered on this server yet (the four are held), so all 200 are told its first estimate: 2 s.
    assert {after for _, _, after in outcomes} == {"2"}

    # Two clients that honour Retry-After arrive while the line is still full: each is turned away and waits.
    caplog.set_level(logging.INFO, logger="openai")
    patient = OpenAI(base_url=url + "/v1", api_key=KEY, timeout=600, max_retries=20)
    chat = {}
    asker = threading.Thread(target=lambda: chat.setdefault("answer", patient.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, messages=[{"role": "user", "content": "Say hello."}])),
        name="patient-client")
    asker.start()
    remote = RemoteEngine(url, KEY)  # as the app and `--server` make it: the client's own RETRIES
    transcription = remote.submit(TranscribeRequest(str(speech["fox"]), model=WHISPER))

    def waits(thread_prefix: str) -> list[float]:
        """The waits the openai client logged before each retry on those threads ("Retrying request in 2.000000
        seconds (retry 1 of 2)")."""
        return [float(r.getMessage().split()[3]) for r in caplog.records
                if r.threadName.startswith(thread_prefix) and r.getMessage().startswith("Retrying request in ")]

    deadline = time.monotonic() + 120
    while not (waits("patient-client") and waits("cadence-remote")):
        assert time.monotonic() < deadline and asker.is_alive(), "a client was never turned away and retried"
        time.sleep(0.05)
    release.set()  # the four leave: the line drains
    for t in holders:
        t.join(600)
    asker.join(600)
    transcript = transcription.result(600)
    remote.shutdown()
    assert len(held) == 4 and not any(t.is_alive() for t in holders + [asker])
    assert set(waits("patient-client")) == {2.0}  # each retry waited what Retry-After said (429s all along)
    assert set(waits("cadence-remote")) == {2.0} and len(waits("cadence-remote")) <= RETRIES

    status, direct = _post(url, body)  # the line is empty now: asked directly, the same greedy answer
    assert status == 200 and chat["answer"].choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert chat["answer"].choices[0].message.content
    with open(speech["fox"], "rb") as f:
        theirs = client.audio.transcriptions.create(model=WHISPER, file=f, response_format="verbose_json",
                                                    timestamp_granularities=["segment"])
    assert transcript.text == theirs.text.strip() and "lazy dog" in transcript.text.lower()
    assert [s.text for s in transcript.segments] == [s.text.strip() for s in theirs.segments]


class DroppingRelay:
    """A loopback TCP relay to a server that drops the first ``drop`` connections once their request has started
    arriving (the connection is lost before any answer), and relays every later one both ways, untouched."""

    def __init__(self, target_url: str, drop: int = 1):
        host, port = target_url.removeprefix("http://").rsplit(":", 1)
        self.target, self.drop, self.dropped, self.relayed = (host, int(port)), drop, 0, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            if self.dropped < self.drop:
                conn.recv(1 << 16)  # the request has started arriving
                conn.close()
                self.dropped += 1
                continue
            self.relayed += 1
            upstream = socket.create_connection(self.target)
            for source, sink in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source, sink) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # the other side closed
            pass

    def close(self) -> None:
        self.listener.close()


def test_a_transcription_whose_connection_drops_is_sent_again_and_answered(small_server, speech, caplog):
    """The connection to the server drops before any answer (a relay on the way closes it): RemoteEngine's client
    sends the whole upload again on a new connection, and the transcript is the server's own."""
    from openai import OpenAI

    from engine.remote import RETRIES, RemoteEngine

    url, _ = small_server
    relay = DroppingRelay(url, drop=1)
    caplog.set_level(logging.INFO, logger="openai")
    remote = RemoteEngine(relay.url, KEY)
    try:
        transcript = remote.submit(TranscribeRequest(str(speech["report"]), model=WHISPER)).result(600)
    finally:
        remote.shutdown()
        relay.close()
    assert (relay.dropped, relay.relayed) == (1, 1)
    retries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Retrying request in ")]
    assert len(retries) == 1 and retries[0].endswith(f"(retry 1 of {RETRIES})"), retries
    with open(speech["report"], "rb") as f:
        theirs = OpenAI(base_url=url + "/v1", api_key=KEY, timeout=600, max_retries=0).audio.transcriptions.create(
            model=WHISPER, file=f, response_format="verbose_json", timestamp_granularities=["segment"])
    assert transcript.text and transcript.text == theirs.text.strip()
    assert [s.text for s in transcript.segments] == [s.text.strip() for s in theirs.segments]


def test_a_server_that_dies_mid_answer_leaves_the_partial_answer_stored(small_server, tmp_path):
    """(The last test of the module: it kills the small server.)"""
    from engine.chat.answering import Conversations
    from engine.errors import CadenceError
    from engine.remote import RemoteEngine

    conversations = Conversations(RemoteEngine(small_server[0], KEY, retries=0), tmp_path / "chats.sqlite")
    reply = conversations.start("Write a long story about a lighthouse.", model=MODEL,
                                params=SamplingParams(max_tokens=2000))
    received = ""
    for text in reply:
        received += text
        if len(received) > 40 and small_server[1].poll() is None:
            small_server[1].kill()  # the server dies mid-answer
    with pytest.raises(CadenceError, match="connection to it was lost|ended before the answer did"):
        reply.wait(60)
    answer = conversations.get(reply.conversation_id).messages[-1]
    assert answer.state == "failed" and answer.content == received and len(received) > 40
    assert answer.error.endswith(".")


def test_a_servers_own_failure_is_named_as_the_servers_in_one_sentence():
    """A 5xx carries the server's internal words (vLLM answered a Whisper folder it could not segment with
    'tuple index out of range'): the sentence says the server failed, with its status; a 4xx's message, which is
    about the request, is passed on as it is."""
    import openai

    from engine.remote import error_sentence
    try:
        import httpx2 as httpx  # what the openai client is built on here
    except ImportError:
        import httpx

    request = httpx.Request("POST", "http://127.0.0.1:9/v1/audio/transcriptions")

    def failure(status: int, message: str) -> openai.APIStatusError:
        cls = openai.InternalServerError if status >= 500 else openai.BadRequestError
        return cls(message, response=httpx.Response(status, request=request), body={"message": message})

    url = "http://127.0.0.1:9/v1"
    assert error_sentence(failure(500, "tuple index out of range"), url) == \
        f"The server at {url} failed on this request (HTTP 500: tuple index out of range)."
    assert error_sentence(failure(400, "Invalid or unsupported audio file."), url) == \
        "Invalid or unsupported audio file."
