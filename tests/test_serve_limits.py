"""`cadence serve`'s bounds, in a server of their own (two slots, at most two requests waiting): beyond the
queue limit a request is answered at once with 429 and Retry-After and none is lost; a server killed
mid-answer leaves the partial answer stored, marked failed."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from serving import start_server, stop_server
from test_serve import KEY, MODEL, _post, _scrape

from engine import SamplingParams


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """Two slots and at most two requests waiting; no Whisper: (URL, process)."""
    proc, url, lines = start_server(tmp_path_factory, KEY, "--precision", "float32", "--batch", "2",
                                    "--max-waiting", "2", "--whisper-model", "none")
    yield url, proc
    stop_server(proc, lines)


def test_requests_beyond_the_queue_limit_are_turned_away_and_none_is_lost(small_server):
    small_server, _ = small_server
    """Both slots busy and two requests waiting (the limit): each of 200 more is answered at once with 429 and
    Retry-After; once the clients holding the four leave, the server answers again."""
    from openai import OpenAI

    client = OpenAI(base_url=small_server + "/v1", api_key=KEY, timeout=600, max_retries=0)
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
        metrics = _scrape(small_server)
        if (metrics.get(("cadence:num_requests_running", model)), metrics.get(("cadence:num_requests_waiting", model))) \
                == (2, 2):
            break
        assert time.monotonic() < deadline, "four long requests never filled two slots and the line"
        time.sleep(0.2)
    body = json.dumps({"model": MODEL, "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    outcomes = []

    def ask():
        request = urllib.request.Request(small_server + "/v1/chat/completions", data=body, headers={
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
    release.set()
    for t in holders:
        t.join(600)
    assert len(outcomes) == 200  # every request was answered
    assert [code for code, _, _ in outcomes] == [429] * 200, outcomes[:3]
    assert all("busy" in text and text.endswith(".") and after.isdigit() and int(after) >= 1
               for _, text, after in outcomes)
    assert len(held) == 4 and not any(t.is_alive() for t in holders)
    deadline = time.monotonic() + 60  # (the four leave within a step or two of their clients closing)
    while (answer := _post(small_server, body))[0] == 429:
        assert time.monotonic() < deadline, "the server still turned requests away a minute after the line emptied"
        time.sleep(0.5)
    assert answer[0] == 200 and answer[1]["choices"][0]["message"]["content"]



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
