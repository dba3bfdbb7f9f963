"""`cadence serve` in a process of its own on loopback, driven by the real `openai` client: the answers
are the engine's own greedy tokens, streamed or not, one or eight at once; bad requests get OpenAI's
error shape with one sentence and leave the server serving."""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from engine import ChatRequest, SamplingParams

KEY = "test-key-1234"
MODEL = "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Name a primary colour.", "List the numbers from one to ten.",
           "Say hello.", "What is two plus two?", "Name a fruit.", "Write one word.", "What colour is the sky?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = dict(os.environ, CADENCE_DATA_DIR=str(tmp_path_factory.mktemp("serve-data")))
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", "0", "--api-key", KEY,
                             "--batch", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"the server ended before it listened: {''.join(lines)}")
        lines.append(line)
        found = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        url = found.group(1) if found else None
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + 300
    while _status(url + "/health") != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(30)
    assert "Traceback" not in "".join(lines)


def _slots(url: str) -> list[dict]:
    request = urllib.request.Request(url + "/slots", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def _status(url: str, data: bytes | None = None, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _post(url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers),
                                    timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key=KEY, timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def engine_answers(engine4):
    """Each prompt's greedy answer from an engine in this process (batched = serial holds across engines)."""
    handles = [engine4.submit(ChatRequest(p, params=SamplingParams(max_tokens=12))) for p in PROMPTS]
    return [h.result(600) for h in handles]


def test_models_and_health(server, client):
    assert _status(server + "/health") == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_answers_are_the_engines_streamed_or_not(client, engine_answers):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    want = engine_answers[0]
    assert whole.choices[0].message.content == want.text and "Paris" in want.text
    assert whole.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert whole.usage.completion_tokens == len(want.tokens)
    assert whole.usage.prompt_tokens == want.stats["prompt_tokens"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.tokens) and not chunks[-1].choices


def test_eight_streams_at_once_equal_their_serial_answers(client, engine_answers):
    got = [None] * len(PROMPTS)

    def ask(i):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                                max_tokens=12, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert got == [a.text for a in engine_answers]


def test_slots_show_eight_busy_and_clients_that_go_away_free_theirs(server, client):
    topics = ("a dragon", "the sea", "a robot", "a city", "winter", "a train", "a garden", "the moon")
    started = threading.Barrier(len(topics) + 1)
    read = threading.Event()

    def ask(topic):
        stream = client.chat.completions.create(model=MODEL, max_tokens=2000, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": f"Write a long story about {topic}."}])
        for number, _ in enumerate(stream):
            if number == 2:  # tokens are coming: this request holds a slot
                break
        started.wait(300)
        read.wait(300)
        stream.close()  # the client goes away mid-answer

    threads = [threading.Thread(target=ask, args=(t,)) for t in topics]
    for t in threads:
        t.start()
    started.wait(300)
    busy = [s for s in _slots(server) if s["is_processing"]]
    read.set()
    for t in threads:
        t.join(300)
    assert len(busy) == 8 and len({s["id_task"] for s in busy}) == 8, busy
    assert all(s["next_token"]["n_decoded"] >= 2 for s in busy)
    deadline = time.monotonic() + 20  # (their stories would take minutes: a cancelled request ends within a step)
    while any(s["is_processing"] for s in _slots(server)):
        assert time.monotonic() < deadline, "slots were still decoding 20 s after their clients left"
        time.sleep(0.2)


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "Hi"}]}).encode(), 404, "not served"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "non-empty list"),
    (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]}).encode(), 400, "role"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(), 400, "must be text"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}).encode(), 400,
     "at least 1"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": "ten"}).encode(),
     400, "whole number"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": -1}).encode(), 400,
     "Temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi " * 12000}]}).encode(), 400, "tokens"),
    (b'{"model": "' + b"a" * (20 << 20) + b'"}', 413, "larger than"),
], ids=["malformed-json", "not-an-object", "unknown-model", "no-messages", "unknown-role", "content-not-text",
        "max-tokens-0", "max-tokens-text", "negative-temperature", "over-the-context", "20-MB-body"])
def test_bad_requests_get_one_sentence_and_the_server_goes_on(server, body, status, words):
    code, answer = _post(server, body)
    assert code == status, answer
    message = answer["error"]["message"]
    assert words in message and message.endswith(".") and "Traceback" not in message
    ok, fine = _post(server, json.dumps({"model": MODEL, "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "Hi"}]}).encode())
    assert ok == 200 and fine["choices"][0]["message"]["role"] == "assistant"


def test_a_missing_or_wrong_key_is_refused(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    for key in (None, "wrong"):
        code, answer = _post(server, body, key=key)
        assert code == 401 and "API key" in answer["error"]["message"]
    assert _status(server + "/v1/models") == 401
    assert _status(server + "/health") == 200  # health needs no key


def test_serving_beyond_loopback_needs_a_key():
    env = {k: v for k, v in os.environ.items() if k != "CADENCE_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--host", "0.0.0.0"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "give an API key" in proc.stderr and proc.stderr.strip().endswith(".")


def test_text_completions_are_the_engines_streamed_or_not(client, engine4, engine_answers):
    prompt = "The capital of France is"
    ids = engine4.reference(MODEL).tokenizer.encode(prompt)
    want = engine4.submit(ChatRequest(prompt_ids=ids, params=SamplingParams(max_tokens=8))).result(600)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.choices[0].text == want.text and whole.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == want.text


def _scrape(server: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_count_the_tokens_served(server, client):
    model = (("model_name", MODEL),)
    before = _scrape(server)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                                            max_tokens=6, temperature=0)
    after = _scrape(server)

    def moved(name, labels=model):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("cadence:generation_tokens_total") == answer.usage.completion_tokens
    assert moved("cadence:prompt_tokens_total") == answer.usage.prompt_tokens
    assert moved("cadence:e2e_request_latency_seconds_count") == 1
    assert moved("cadence:time_to_first_token_seconds_count") == 1
    reason = (("finished_reason", answer.choices[0].finish_reason), ("model_name", MODEL))
    assert moved("cadence:request_success_total", reason) == 1
    assert after[("cadence:lane_width", model)] == 8
    assert after[("cadence:num_requests_running", model)] == 0 and after[("cadence:num_requests_waiting", model)] == 0
    drafted, accepted = after[("cadence:spec_decode_num_draft_tokens_total", model)], \
        after[("cadence:spec_decode_num_accepted_tokens_total", model)]
    by_position = sum(v for (name, _), v in after.items() if name == "cadence:spec_decode_num_accepted_tokens_per_pos_total")
    assert 0 <= accepted <= drafted and by_position == accepted
