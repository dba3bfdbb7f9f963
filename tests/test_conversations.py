"""Stored conversations (engine/chat/) on the real model and a real SQLite file.

Invariants: greedy answers equal the reference decoder's, alone, with 8 conversations at once and
over several turns; earlier answers and edits are kept as siblings; context overflow leaves out
the oldest turns (never the system prompt) and says so; a refused or invalid request leaves the
store exactly as it was; a process killed mid-answer leaves its finished messages intact and the
partial answer marked interrupted; coalesced deltas keep the exact text.
"""

import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from parity import assert_same_or_near_tie

from engine.chat.reference import build_messages
from engine.api import coalesce, drain, follow
from engine.chat.answering import Conversations
from engine.chat.store import MAX_MESSAGE_CHARS
from engine import ChatRequest
from engine.api import ChatAnswer, ChatStarted, Delta, Finished, Progress
from engine.errors import CadenceError
from engine.chat.run import DOCUMENT_SHARE, prompt_budget
from engine.sampling import SamplingParams
from engine.transcript import Segment, Transcript

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn rain.",
    "List three fruits that are red.",
    "Explain in two sentences why the sea is salty.",
    "Name a famous painter.",
    "Give me a tip for sleeping better.",
    "What is two plus two?",
    "Describe a cat in one sentence.",
]
FILLER = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
SLOT = 1024  # smollm2's slot length in engine4 (tests/conftest.py)


@pytest.fixture
def db_file(tmp_path):
    return tmp_path / "cadence.sqlite3"


@pytest.fixture
def convs(engine4, db_file):
    store = Conversations(engine4, db_file)
    yield store
    store.close()


def snapshot(path):
    """Every row of the conversation tables, to show that nothing changed."""
    db = sqlite3.connect(path)
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY id").fetchall() for t in ("conversations", "messages")}
    finally:
        db.close()


def reference_tokens(chat_ref, messages, max_tokens):
    ids = chat_ref.prompt_ids(messages)
    return ids, chat_ref.generate(ids, SamplingParams(max_tokens=max_tokens)).tokens


# ---------------------------------------------------------------- exactness
def test_greedy_answers_equal_the_reference_alone_and_eight_at_once(convs, chat_ref, db_file):
    params = {"max_tokens": 24}
    alone = convs.start(PROMPTS[0], params=params)
    alone.wait(300)
    first = ids, want = reference_tokens(chat_ref, build_messages(PROMPTS[0]), 24)  # (used again below)
    assert_same_or_near_tie(chat_ref, ids, alone.result.tokens, want)

    replies = [convs.start(p, params=params) for p in PROMPTS]  # all eight submitted before any is read
    assert len({r.conversation_id for r in replies}) == 8
    for prompt, reply in zip(PROMPTS, replies):
        message = reply.wait(600)
        ids, want = first if prompt == PROMPTS[0] else reference_tokens(chat_ref, build_messages(prompt), 24)
        assert_same_or_near_tie(chat_ref, ids, reply.result.tokens, want)
        assert message.state == "complete" and message.content == reply.result.text
        assert message.stats["tokens"] == len(reply.result.tokens) and message.stats["dropped_turns"] == 0
        assert message.stats["finish_reason"] == reply.result.finish_reason
    stored = Conversations(None, db_file)  # as another process sees it
    assert [c["messages"] for c in stored.list()] == [2] * 9


def test_multi_turn_history_equals_the_reference(convs, chat_ref):
    system = "You are a helpful assistant who answers briefly."
    first = convs.start("Name a large animal.", system=system, params={"max_tokens": 16})
    first.wait(300)
    second = convs.send(first.conversation_id, "Where does it live?")
    second.wait(300)
    history = [{"role": "user", "content": "Name a large animal."}, {"role": "assistant", "content": first.result.text}]
    ids, want = reference_tokens(chat_ref, build_messages("Where does it live?", system, history), 16)
    assert second.result.stats["prompt_tokens"] == len(ids)
    assert_same_or_near_tie(chat_ref, ids, second.result.tokens, want)
    conv = convs.get(first.conversation_id)
    assert [(m.role, m.content) for m in conv.messages] == [
        ("user", "Name a large animal."), ("assistant", first.result.text),
        ("user", "Where does it live?"), ("assistant", second.result.text)]
    assert conv.system == system and conv.title == "Name a large animal."


# ---------------------------------------------------------------- branches, delete, export
def test_regenerate_keeps_the_old_answer_and_edit_makes_a_branch(convs, db_file):
    params = {"temperature": 1.0, "max_tokens": 8}  # unseeded: answers differ, ids tell them apart anyway
    first = convs.start("Tell me a colour.", params=params)
    first.wait(300)
    second = convs.send(first.conversation_id, "Tell me an animal.")
    second.wait(300)
    cid = first.conversation_id

    again = convs.regenerate(second.message_id)
    again.wait(300)
    assert again.user_message_id == second.user_message_id  # the same question, a new answer beside the old
    siblings = convs.siblings(second.message_id)
    assert [m.id for m in siblings] == [second.message_id, again.message_id]
    assert siblings[0].content == second.result.text and siblings[0].state == "complete"
    branch = convs.get(cid).messages
    assert [m.id for m in branch][-1] == again.message_id and (branch[-1].sibling_index, branch[-1].siblings) == (1, 2)
    branch = convs.choose(second.message_id).messages  # flip back to the earlier answer
    assert branch[-1].id == second.message_id and branch[-1].content == second.result.text

    edited = convs.edit(first.user_message_id, "Tell me a number.")
    edited.wait(300)
    branch = convs.get(cid).messages
    assert [(m.role, m.content) for m in branch] == [("user", "Tell me a number."), ("assistant", edited.result.text)]
    assert [m.id for m in convs.siblings(edited.user_message_id)] == [first.user_message_id, edited.user_message_id]
    branch = convs.choose(first.user_message_id).messages  # the old branch, with the answer chosen before
    assert [m.id for m in branch] == [first.user_message_id, first.message_id, second.user_message_id,
                                      second.message_id]

    convs.delete_message(second.user_message_id)  # the question and both its answers
    assert [m.id for m in convs.get(cid).messages] == [first.user_message_id, first.message_id]
    with pytest.raises(CadenceError, match="no message"):
        convs.message(again.message_id)
    convs.delete(cid)
    with pytest.raises(CadenceError, match="no conversation"):
        convs.get(cid)
    assert snapshot(db_file) == {"conversations": [], "messages": []}


def test_export_markdown_and_json(convs):
    first = convs.start("Say hello to Ada.", system="Be brief.", params={"max_tokens": 8, "top_k": 5})
    first.wait(300)
    again = convs.regenerate(first.message_id)
    again.wait(300)
    cid = first.conversation_id

    md = convs.export(cid, "md")
    assert md.startswith("# Say hello to Ada.\n")
    assert "- Model: smollm2-135m-instruct" in md and "top k 5" in md and "max tokens 8" in md
    assert "## System\n\nBe brief." in md
    assert "## You\n\nSay hello to Ada." in md
    assert f"## Assistant (version 2 of 2)\n\n{again.result.text}" in md
    assert md.index("Say hello to Ada.\n\n## Assistant") > md.index("## System")

    data = json.loads(convs.export(cid, "json"))
    assert data["id"] == cid and data["system"] == "Be brief." and data["params"]["top_k"] == 5
    assert [(m["role"], m["content"]) for m in data["messages"]] == [("user", "Say hello to Ada."),
                                                                     ("assistant", again.result.text)]
    assert [m["id"] for m in data["other_messages"]] == [first.message_id]
    assert data["other_messages"][0]["content"] == first.result.text
    assert data["messages"][1]["stats"]["tokens"] == len(again.result.tokens)
    with pytest.raises(CadenceError, match="md or json"):
        convs.export(cid, "pdf")


# ---------------------------------------------------------------- context limits
def test_context_overflow_leaves_out_the_oldest_turns_never_the_system_prompt(convs, chat_ref):
    system = "You are a careful note keeper."
    # ~ 230-290 tokens each, all of different lengths, so the prompt's length tells which turns it holds
    notes = [f"Note {i}: " + FILLER * n for i, n in zip(range(1, 5), (18, 16, 15, 17))]
    params = {"max_tokens": 4}
    budget = prompt_budget(SLOT, 4)
    reply = convs.start(notes[0], system=system, params=params)
    reply.wait(300)
    cid = reply.conversation_id
    history = [{"role": "user", "content": notes[0]}, {"role": "assistant", "content": reply.result.text}]
    for note in notes[1:3]:
        reply = convs.send(cid, note)
        reply.wait(300)
        assert reply.dropped_turns == 0
        history += [{"role": "user", "content": note}, {"role": "assistant", "content": reply.result.text}]
    assert len(chat_ref.prompt_ids(build_messages(notes[3], system, history))) > budget  # it does overflow

    last = convs.send(cid, notes[3])
    message = last.wait(300)
    assert last.dropped_turns == 1 and message.stats["dropped_turns"] == 1
    ids = chat_ref.prompt_ids(build_messages(notes[3], system, history[2:]))  # the first turn left out, system kept
    assert len(ids) <= budget and last.result.stats["prompt_tokens"] == len(ids)
    want = chat_ref.generate(ids, SamplingParams(max_tokens=4)).tokens
    assert_same_or_near_tie(chat_ref, ids, last.result.tokens, want)
    assert len(convs.get(cid).messages) == 8  # nothing is deleted from the store: only left out of the prompt
    assert "1 earlier turns were left out" in convs.export(cid, "md")


def test_a_single_message_too_long_for_the_context_fails_and_nothing_is_stored(convs, db_file):
    first = convs.start("Hello.", params={"max_tokens": 4})
    first.wait(300)
    before = snapshot(db_file)
    huge = FILLER * 220  # ~ 3000 tokens, far below the character limit
    assert len(huge) < MAX_MESSAGE_CHARS
    reply = convs.send(first.conversation_id, huge)
    with pytest.raises(CadenceError, match=r"tokens, more than the \d+ this model takes"):
        reply.wait(300)
    assert reply.rejected
    with pytest.raises(CadenceError, match="tokens"):
        convs.start(huge).wait(300)  # a new conversation is not kept either
    assert snapshot(db_file) == before
    ok = convs.send(first.conversation_id, "Goodbye.")  # the conversation goes on as before
    ok.wait(300)
    assert [m.content for m in convs.get(first.conversation_id).messages][::2] == ["Hello.", "Goodbye."]


# ---------------------------------------------------------------- bad input
def test_bad_input_is_one_sentence_and_changes_nothing(convs, db_file):
    first = convs.start("Hello.", params={"max_tokens": 4})
    first.wait(300)
    cid = first.conversation_id
    before = snapshot(db_file)
    cases = [
        (lambda: convs.send(cid, ""), "empty"),
        (lambda: convs.send(cid, "   \n "), "empty"),
        (lambda: convs.send(cid, "x" * 2**20), "at most 100,000"),
        (lambda: convs.start("x" * 2**20), "at most 100,000"),
        (lambda: convs.create(params={"temperature": -1}), "Temperature"),
        (lambda: convs.create(params={"top_p": 1.5}), "top-p"),
        (lambda: convs.start("hi", params={"temperature": -0.5}), "Temperature"),
        (lambda: convs.start("hi", params={"top_p": 1.01}), "top-p"),
        (lambda: convs.start("hi", params={"wobble": 1}), "Unknown sampling setting"),
        (lambda: convs.start("hi", params={"seed": "abc"}), "seed"),
        (lambda: convs.update(cid, params={"top_p": 2}), "top-p"),
        (lambda: convs.create(model="no-such-model"), "Unknown model"),
        (lambda: convs.send(987654, "hi"), "no conversation 987654"),
        (lambda: convs.regenerate(987654), "no message"),
        (lambda: convs.regenerate(first.user_message_id), "Only an answer"),
        (lambda: convs.edit(first.message_id, "new"), "Only your own messages"),
        (lambda: convs.edit(first.user_message_id, ""), "empty"),
        (lambda: convs.delete(987654), "no conversation"),
    ]
    for call, words in cases:
        with pytest.raises(CadenceError, match=words) as caught:
            call()
        sentence = str(caught.value)
        assert sentence.endswith(".") and "\n" not in sentence, sentence
    assert snapshot(db_file) == before


# ---------------------------------------------------------------- stop, close, kill
def _first_words(reply, n=3):
    seen = []
    for text in reply:
        seen.append(text)
        if len(seen) >= n:
            return


def test_stop_keeps_the_partial_answer_and_close_marks_it_interrupted(convs, db_file):
    story = convs.start("Write a long story about a dragon.", params={"max_tokens": 300})
    _first_words(story)
    assert convs.stop(story.message_id)
    message = story.wait(300)
    assert message.state == "stopped" and message.stats["finish_reason"] == "cancelled"
    assert message.content and message.content == story.result.text and len(story.result.tokens) < 300

    other = convs.start("Write a long story about a knight.", params={"max_tokens": 300})
    _first_words(other)
    convs.close()  # the app goes away mid-answer
    assert other.done
    message = convs.message(other.message_id)
    # The text so far (the engine's own decoding of the tokens, which the streamed text never runs ahead of).
    assert message.state == "interrupted" and other.text and message.content.startswith(other.text)
    assert not convs.stop(other.message_id)  # nothing left in flight


def test_a_real_kill_keeps_finished_messages_and_marks_the_partial_answer_interrupted(convs, tmp_path, db_file):
    first = convs.start("Say hello.", params={"max_tokens": 8})
    first.wait(300)
    cid = first.conversation_id
    finished_rows = snapshot(db_file)["messages"]
    env = dict(os.environ, CADENCE_DATA_DIR=str(tmp_path), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "chat", "Write a long story about a dragon.",
                             "--conversation", str(cid), "--max-tokens", "400", "--batch", "off"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    db = sqlite3.connect(db_file)
    try:
        deadline, partial = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            row = db.execute("SELECT id, content FROM messages WHERE state = 'streaming'").fetchone()
            if row and len(row[1]) > 40:
                partial = row
                break
            time.sleep(0.05)
        assert partial is not None, f"no partial answer was stored: {proc.stderr.read() if proc.poll() else ''}"
        assert Conversations(None, db_file).recover() == 0  # a live writer's answer is left alone
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert db.execute("SELECT state FROM messages WHERE id = ?", (partial[0],)).fetchone()[0] == "streaming"
    finally:
        proc.kill()
        db.close()

    reopened = Conversations(None, db_file)  # "restart"
    assert reopened.recovered == 1
    after = snapshot(db_file)["messages"]
    assert after[: len(finished_rows)] == finished_rows  # every finished message exactly as it was
    conv = reopened.get(cid)
    assert [(m.role, m.state) for m in conv.messages] == [("user", "complete"), ("assistant", "complete"),
                                                          ("user", "complete"), ("assistant", "interrupted")]
    assert conv.messages[2].content == "Write a long story about a dragon."
    assert conv.messages[3].id == partial[0] and conv.messages[3].content.startswith(partial[1])
    assert len(after) == 4
    # The conversation goes on from the interrupted answer (its text is part of the history). (The command above
    # set the conversation's answers to 400 tokens; 8 show it goes on, in a fraction of the time.)
    convs.update(cid, params={"max_tokens": 8})
    more = convs.send(cid, "Thank you.")
    assert more.wait(300).state == "complete"
    assert more.result.stats["prompt_tokens"] > 40


# ---------------------------------------------------------------- transcripts
def _meeting(minutes: int) -> Transcript:
    segments = [Segment(30.0 * i, 30.0 * (i + 1), f"In part {i} we talked about item {i} and agreed to follow up. "
                        + FILLER * 3) for i in range(minutes * 2)]
    return Transcript(file="/recordings/meeting.wav", text=" ".join(s.text for s in segments), language="en",
                      duration=60.0 * minutes, segments=segments, stats={})


def test_chat_about_a_transcript_cuts_it_to_fit_with_a_notice(convs, engine4):
    long = _meeting(40)
    cid, reply = convs.create_about_transcript(long, "Summarize the meeting.", params={"max_tokens": 6}, job_id=7)
    reply.wait(300)
    assert reply.notice and reply.notice.startswith("The transcript was cut to the first ")
    conv = convs.get(cid)
    transcript = conv.context["transcript"]
    assert transcript["job_id"] == 7 and transcript["fitted"] and transcript["notice"] == reply.notice
    assert transcript["text"] == long.text  # the whole transcript is kept, only the prompt holds a cut
    assert "(cut to the first " in conv.system and "of 40:00 to fit)" in conv.system
    used = transcript["parts_used"]
    assert 0 < used < len(long.segments)
    assert long.segments[used - 1].text.strip() in conv.system and long.segments[used].text.strip() not in conv.system
    assert f"the first {used // 2}:{'30' if used % 2 else '00'} of 40:00" in reply.notice
    share = int(prompt_budget(SLOT, 6) * DOCUMENT_SHARE)
    assert share - 200 < reply.result.stats["prompt_tokens"] <= share  # cut close to what fits, not far below
    assert conv.title == "About meeting.wav"

    follow_up = convs.send(cid, "Who spoke?")  # later turns use the stored, already cut system prompt
    follow_up.wait(300)
    assert follow_up.result.stats["prompt_tokens"] > reply.result.stats["prompt_tokens"]
    assert convs.get(cid).system == conv.system

    short_cid, short = convs.create_about_transcript("We agreed to ship on Friday.", "When do we ship?",
                                                     params={"max_tokens": 6})
    short.wait(300)
    short_conv = convs.get(short_cid)
    assert short.notice is None and short_conv.context["transcript"]["notice"] is None
    assert "Transcript:\nWe agreed to ship on Friday." in short_conv.system

    text_cid, text_reply = convs.create_about_transcript(long.text, "Summarize.", params={"max_tokens": 4})
    text_reply.wait(300)
    assert f"of {len(long.text.rstrip()):,} characters to fit this model's context." in text_reply.notice


def test_chat_about_a_finished_transcription_job(convs, db_file):
    from engine.jobs import JobStore

    jobs = JobStore(db_file)
    job = jobs.create("/recordings/standup.wav", "whisper-tiny.en")
    with pytest.raises(CadenceError, match="has not finished"):
        convs.create_about_transcript(job, "Summarize.")
    jobs.finished(job, _meeting(1).to_json() | {"file": "/recordings/standup.wav"})
    cid, reply = convs.create_about_transcript(job, params={"max_tokens": 6})  # no instruction: answered on send
    assert reply is None and convs.get(cid).context["transcript"]["job_id"] == job
    answer = convs.send(cid, "What was agreed?")
    answer.wait(300)
    assert answer.notice is None and "In part 1 we talked about item 1" in convs.get(cid).system


# ---------------------------------------------------------------- streaming rate and coalescing
def test_coalescing_keeps_the_exact_text(engine4):
    params = SamplingParams(max_tokens=48, stop=["banana"])
    handle = engine4.submit(ChatRequest("Write a short poem with a few emoji and accented words like café.",
                                        params=params))
    deadline = time.monotonic() + 300
    while not handle.ended and time.monotonic() < deadline:  # an absent reader: everything piles up
        time.sleep(0.05)
    events = drain(handle.events)
    deltas = [e for e in events if e.kind == "delta"]
    merged = coalesce(events)
    assert [e.kind for e in merged] == ["started", "delta", "finished"] and len(deltas) > 10
    result = merged[-1].result
    assert merged[1].text == "".join(e.text for e in deltas) == result.text
    assert merged[1].tokens == result.tokens

    slow = engine4.submit(ChatRequest("Count from one to twenty in words.", params=SamplingParams(max_tokens=64)))
    texts = []
    deadline = time.monotonic() + 300
    for event in follow(slow.events):  # a reader that falls behind after its first read (however fast the
        if event.kind == "delta":      # machine: it waits for the answer to end), so the rest piles up
            texts.append(event.text)
            while len(texts) == 1 and not slow.ended and time.monotonic() < deadline:
                time.sleep(0.05)
    assert "".join(texts) == slow.result().text and len(texts) < len(slow.result().tokens) - 1

    a, b = Delta(1, text="é", tokens=[5]), Delta(2, text="x", tokens=[6])
    mixed = coalesce([a, Delta(1, text="t", tokens=[7]), b, Progress(1, index=0), a])
    assert [(e.request_id, e.kind, getattr(e, "text", None), getattr(e, "tokens", None)) for e in mixed] == [
        (1, "delta", "ét", [5, 7]), (2, "delta", "x", [6]), (1, "progress", "", None), (1, "delta", "é", [5])]


class _FloodHandle:
    """A stand-in for an engine handle that produces deltas faster than any model does."""

    _ids = iter(range(10_000, 20_000))

    def __init__(self, pieces):
        self.id = next(self._ids)
        self.events = queue.Queue()
        self.cancelled = False

        def produce():
            self.events.put(ChatStarted(self.id))
            for i, piece in enumerate(pieces):
                self.events.put(Delta(self.id, text=piece, tokens=[i]))
            self.events.put(Finished(self.id, answer=ChatAnswer(
                text="".join(pieces), tokens=list(range(len(pieces))), finish_reason="length",
                stats={"tokens": len(pieces)})))

        threading.Thread(target=produce, daemon=True).start()

    def __iter__(self):
        while True:
            event = self.events.get()
            yield event
            if event.terminal:
                return

    def cancel(self):
        self.cancelled = True


class _FloodEngine:
    def __init__(self, pieces):
        self.pieces = pieces

    def submit(self, request):
        return _FloodHandle(self.pieces)


def test_a_slow_reader_never_falls_behind_and_the_store_is_written_sparingly(db_file, monkeypatch):
    pieces = [f" w{i}" + ("é" if i % 7 == 0 else "") for i in range(20_000)]
    store = Conversations(_FloodEngine(pieces), db_file)
    writes = []
    original = store._write_partial
    monkeypatch.setattr(store, "_write_partial", lambda reply: (writes.append(1), original(reply)))
    reply = store.start("hi")
    reads = []
    for text in reply:  # 20 ms per read: a busy UI thread
        reads.append(text)
        time.sleep(0.02)
    message = reply.wait(60)
    assert "".join(reads) == "".join(pieces) == message.content and message.state == "complete"
    assert len(reads) < 200  # 20,000 deltas arrive in few, long reads
    assert list(reply) == []  # read to the end: iterating again does not wait for more
    assert len(writes) <= 20_000 // 128 + 2


def test_fitting_leaves_out_whole_oldest_turns_and_keeps_the_system_prompt():
    from engine.chat.run import fit_history, split_turns

    def render(messages):  # one "token" per character, the role included, so every message costs something
        return [0] * sum(len(m["role"]) + len(m["content"]) for m in messages)

    history = [{"role": "assistant", "content": "Hi!"}]  # an opening answer belongs to the first turn
    for i in range(1, 6):
        history += [{"role": "user", "content": f"q{i}" * 10}, {"role": "assistant", "content": f"a{i}" * 10}]
    assert [len(t) for t in split_turns(history)] == [1, 2, 2, 2, 2, 2]
    full = len(render(build_messages("last", "SYSTEM", history)))
    per_turn = len("user") + 20 + len("assistant") + 20
    ids, dropped = fit_history(render, "SYSTEM", history, "last", full)
    assert dropped == 0 and len(ids) == full
    ids, dropped = fit_history(render, "SYSTEM", history, "last", full - len("assistantHi!") - 2 * per_turn)
    assert dropped == 3 and len(ids) == full - len("assistantHi!") - 2 * per_turn
    ids, dropped = fit_history(render, "SYSTEM", history, "last", full - len("assistantHi!") - 2 * per_turn - 1)
    assert dropped == 4
    alone = len(render(build_messages("last", "SYSTEM")))
    ids, dropped = fit_history(render, "SYSTEM", history, "last", alone)
    assert dropped == 6 and len(ids) == alone  # everything but the system prompt and the message
    with pytest.raises(CadenceError, match="The message and the system prompt come to"):
        fit_history(render, "SYSTEM", history, "last", alone - 1)
