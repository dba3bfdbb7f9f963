"""`cadence serve` in a process of its own on loopback, driven by the real `openai` client: the answers
are the engine's own greedy tokens, streamed or not, one or eight at once; transcriptions are the
engine's in every response format; bad requests get OpenAI's error shape with one sentence and leave
the server serving (its queue limit and a server that dies: test_serve_limits.py)."""

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

from serving import start_server, status, stop_server

from engine import ChatRequest, SamplingParams, TranscribeRequest

KEY = "test-key-1234"
MODEL = "smollm2-135m-instruct"
WHISPER = "whisper-tiny.en"
MAX_AUDIO_MB = 2
PROMPTS = ["What is the capital of France?", "Name a primary colour.", "List the numbers from one to ten.",
           "Say hello.", "What is two plus two?", "Name a fruit.", "Write one word.", "What colour is the sky?"]


def _serve(tmp_path_factory, *flags):
    proc, url, lines = start_server(tmp_path_factory, KEY, "--precision", "float32", *flags)
    yield url
    stop_server(proc, lines)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _serve(tmp_path_factory, "--batch", "8", "--context", "2048", "--max-audio-mb", str(MAX_AUDIO_MB))


def _slots(url: str) -> list[dict]:
    request = urllib.request.Request(url + "/slots", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


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
    assert status(server + "/health") == 200
    assert [m.id for m in client.models.list().data] == [MODEL, WHISPER]


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
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": -5}).encode(), 400,
     "at least 1"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**9}).encode(), 400,
     "must leave room for the prompt"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": -1}).encode(), 400,
     "Temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi " * 12000}]}).encode(), 400, "tokens"),
    (b'{"model": "' + b"a" * (20 << 20) + b'"}', 413, "larger than"),
], ids=["malformed-json", "not-an-object", "unknown-model", "no-messages", "unknown-role", "content-not-text",
        "max-tokens-0", "max-tokens-text", "max-tokens-negative", "max-tokens-huge", "negative-temperature", "over-the-context", "20-MB-body"])
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
    assert status(server + "/v1/models") == 401
    assert status(server + "/health") == 200  # health needs no key


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
    by_position = sum(v for (name, labels), v in after.items()
                      if name == "cadence:spec_decode_num_accepted_tokens_per_pos_total" and model[0] in labels)
    assert 0 <= accepted <= drafted and by_position == accepted


def test_a_client_that_leaves_a_whole_answer_frees_its_slot(server):
    body = json.dumps({"model": MODEL, "max_tokens": 2000, "temperature": 0,
                       "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}]}).encode()
    request = urllib.request.Request(server + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(OSError):  # the client gives up waiting and closes its connection
        urllib.request.urlopen(request, timeout=4)
    deadline = time.monotonic() + 20  # (the story would take minutes)
    while any(s["is_processing"] for s in _slots(server)):
        assert time.monotonic() < deadline, "a slot was still decoding 20 s after its client left"
        time.sleep(0.2)


# ---------------------------------------------------------------------------- audio
GLOSSARY = "Kwik Braun Phocks, Finance Team."


@pytest.fixture(scope="module")
def engine_transcripts(engine4, speech):
    """The engine's own transcripts on the default path (voice-activity windows, timed phrases)."""
    asks = {"long": {}, "fox": {}, "fox-prompt": {"initial_prompt": GLOSSARY}}
    handles = {name: engine4.submit(TranscribeRequest(speech[name.split("-")[0]], timestamps=True, **extra))
               for name, extra in asks.items()}
    return {name: h.result(600) for name, h in handles.items()}


def _transcribe(client, path, fmt, **extra):
    with open(path, "rb") as f:
        return client.audio.transcriptions.create(model="whisper-1", file=f, response_format=fmt, **extra)


def _clock(text: str) -> float:
    h, m, s = text.replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def _cues(text: str, decimal: str) -> list[tuple[float, float, str]]:
    """(start, end, text) of each SRT or VTT cue; asserts each block's shape."""
    out = []
    for block in [b for b in text.strip().split("\n\n") if b != "WEBVTT"]:
        lines = block.split("\n")
        if decimal == ",":
            assert lines.pop(0) == str(len(out) + 1), block
        found = re.fullmatch(rf"(\d\d:\d\d:\d\d{decimal}\d{{3}}) --> (\d\d:\d\d:\d\d{decimal}\d{{3}})", lines[0])
        assert found and all(lines[1:]), block
        out.append((_clock(found.group(1)), _clock(found.group(2)), " ".join(lines[1:])))
    return out


def test_transcriptions_are_the_engines_in_every_format(client, speech, engine_transcripts):
    want = engine_transcripts["long"]
    assert _transcribe(client, speech["long"], "json").text == want.text
    assert _transcribe(client, speech["long"], "text") == want.text + "\n"
    for fmt, decimal in (("srt", ","), ("vtt", ".")):
        text = _transcribe(client, speech["long"], fmt)
        assert text.startswith("WEBVTT\n\n") == (fmt == "vtt")
        cues = _cues(text, decimal)
        assert all(a <= b for a, b, _ in cues) and all(p[1] <= n[0] for p, n in zip(cues, cues[1:]))
        assert " ".join(t for _, _, t in cues).split() == want.text.split()
    verbose = _transcribe(client, speech["long"], "verbose_json", timestamp_granularities=["segment", "word"])
    assert verbose.text == want.text and verbose.language == "en" and abs(verbose.duration - want.duration) < 1e-3
    assert [s.tokens for s in verbose.segments] == [s.tokens for s in want.segments]
    starts = [s.start for s in verbose.segments]
    assert starts == sorted(starts) and all(s.start <= s.end for s in verbose.segments)
    assert all(-10 < s.avg_logprob <= 0 and 0 <= s.no_speech_prob <= 1 for s in verbose.segments)
    words = verbose.words
    assert " ".join(w.word for w in words).split() == want.text.split()
    assert all(a.start <= b.start for a, b in zip(words, words[1:]))


def test_a_prompt_steers_the_transcription_as_it_does_the_engines(client, speech, engine_transcripts):
    steered = _transcribe(client, speech["fox"], "json", prompt=GLOSSARY)
    assert steered.text == engine_transcripts["fox-prompt"].text and "Phocks" in steered.text
    assert _transcribe(client, speech["fox"], "json").text == engine_transcripts["fox"].text != steered.text


def _bad_audio(tmp_path, kind: str) -> tuple[str, bytes]:
    import numpy as np

    rng = np.random.default_rng(0)
    if kind == "junk-bytes":
        return "noise.wav", rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    if kind == "empty-file":
        return "empty.wav", b""
    if kind == "no-audio-track":
        from test_audio_inputs import _mp4_with_only_video

        return "video.mp4", _mp4_with_only_video(tmp_path / "video.mp4").read_bytes()
    return "huge.wav", rng.integers(0, 256, (MAX_AUDIO_MB + 1) << 20, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("kind, extra, status, words", [
    ("junk-bytes", {}, 400, "noise.wav is not an audio or video file"),
    ("empty-file", {}, 400, "empty.wav is empty"),
    ("no-audio-track", {}, 400, "video.mp4 has no audio track"),
    ("over-the-limit", {}, 413, f"larger than this server takes ({MAX_AUDIO_MB} MB"),
    ("junk-bytes", {"model": "whisper-9"}, 404, "does not transcribe here"),
    ("junk-bytes", {"response_format": "docx"}, 400, "'response_format' must be one of"),
    ("junk-bytes", {"temperature": 0.5}, 400, "greedy"),
])
def test_bad_audio_gets_one_sentence_and_the_server_goes_on(client, tmp_path, kind, extra, status, words):
    import openai

    name, data = _bad_audio(tmp_path, kind)
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(**{"model": "whisper-1", "file": (name, data), **extra})
    assert info.value.status_code == status
    message = info.value.body["message"] if "message" in info.value.body else info.value.body["error"]["message"]
    assert words in message and message.endswith(".") and "Traceback" not in message
    fine = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert fine.choices[0].message.role == "assistant"


# The client library marks its translations method deprecated (the hosted endpoint is being retired);
# Cadence's server keeps the endpoint, so the library's notice says nothing about what is tested here.
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_an_english_only_model_refuses_to_translate(client, speech):
    import openai

    with pytest.raises(openai.BadRequestError, match="English-only; it cannot translate"):
        with open(speech["fox"], "rb") as f:
            client.audio.translations.create(model=WHISPER, file=f)


# ---------------------------------------------------------------------------- the command line on a server
def _cli(server, *args, data_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, CADENCE_DATA_DIR=str(data_dir), CADENCE_SERVER=server, CADENCE_API_KEY=KEY)
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_cli_chat_on_a_server_streams_the_engines_answer_and_stores_it(server, engine_answers, tmp_path):
    done = _cli(server, "chat", PROMPTS[0], "--max-tokens", "12", data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == engine_answers[0].text + "\n" and f"on server {server}/v1" in done.stderr
    stored = json.loads(_cli(server, "chat", "--export", "1", "--json", data_dir=tmp_path).stdout)
    assert stored["model"] == MODEL and stored["messages"][-1]["content"] == engine_answers[0].text
    refused = _cli(server, "chat", "Hi", "--batch", "4", data_dir=tmp_path)
    assert refused.returncode == 2 and "with --server the server runs its own" in refused.stderr


def test_cli_transcribe_on_a_server_gives_the_engines_transcripts(server, speech, engine_transcripts, tmp_path):
    done = _cli(server, "transcribe", str(speech["fox"]), str(speech["long"]), "--json", data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    entries = json.loads(done.stdout)
    assert [e["text"] for e in entries] == [engine_transcripts["fox"].text, engine_transcripts["long"].text]
    assert [[s["start"] for s in e["segments"]] for e in entries] == \
        [[round(s.start, 3) for s in engine_transcripts[n].segments] for n in ("fox", "long")]


def test_a_transcript_too_long_for_the_servers_context_is_cut_to_fit(server, tmp_path):
    """A chat about a transcript over a server: where the server says the prompt passes its context, the
    transcript is halved until it fits, and the conversation notes the cut, as on this computer."""
    from engine.chat.answering import Conversations
    from engine.remote import RemoteEngine

    sentence = "The committee reviewed the budget for the northern depot and agreed to repaint the trucks. "
    segments = [{"start": 6.0 * i, "end": 6.0 * i + 6, "text": f"Item {i}. {sentence * 4}"} for i in range(40)]
    transcript = {"file": "meeting.wav", "text": " ".join(s["text"] for s in segments), "duration": 240.0,
                  "segments": segments}
    conversations = Conversations(RemoteEngine(server, KEY, retries=0), tmp_path / "chats.sqlite")
    _, reply = conversations.create_about_transcript(transcript, "Which depot?", model=MODEL,
                                                     params=SamplingParams(max_tokens=4))
    assert reply.wait(600).state == "complete"
    fitted = conversations.get(reply.conversation_id).context["transcript"]
    assert fitted["fitted"] and fitted["parts_used"] in (20, 10, 5) and "was cut to" in fitted["notice"]
