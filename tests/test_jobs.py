"""Transcription jobs in the SQLite store: recorded as they go, resumed without redoing windows,
failed and cancelled one by one while the others finish."""

import shutil

import pytest

from engine.errors import CadenceError
from engine.jobs import JobStore, settle_job, submit_job
from engine.transcript import WindowResult


@pytest.fixture
def jobs(tmp_path):
    return JobStore(tmp_path / "store.sqlite3")


def run(engine, jobs, job_id):
    return settle_job(jobs, job_id, submit_job(engine, jobs, job_id))


def test_a_job_records_its_plan_windows_and_transcript(engine4, jobs, speech):
    job_id = jobs.create(speech["long"], "whisper-tiny.en", {"task": "transcribe"})
    assert jobs.get(job_id).state == "queued"
    transcript = run(engine4, jobs, job_id)
    job = jobs.get(job_id)
    assert job.state == "done" and job.windows_total == 2 and job.windows_done == 2
    assert job.language == "en" and job.duration == pytest.approx(transcript.duration)
    assert job.result["text"] == transcript.text and "report" in transcript.text.lower()
    stored = jobs.windows(job_id)
    assert [s.tokens for s in transcript.segments] == [stored[0].tokens, stored[1].tokens]


def test_resume_decodes_only_the_missing_windows_and_gives_the_same_transcript(engine4, jobs, speech):
    first = jobs.create(speech["long"], "whisper-tiny.en")
    whole = run(engine4, jobs, first)
    # A job killed after its first window: window 0 is stored, window 1 is not.
    resumed = jobs.create(speech["long"], "whisper-tiny.en")
    jobs.started(resumed, 2, "en", whole.duration)
    jobs.add_window(resumed, 0, jobs.windows(first)[0])
    lane = engine4._lanes["whisper-tiny.en"]
    tokens_before = lane.counters.tokens
    again = run(engine4, jobs, resumed)
    assert [s.tokens for s in again.segments] == [s.tokens for s in whole.segments]
    assert again.text == whole.text
    # Only window 1 was decoded this time (its tokens plus nothing for window 0).
    assert lane.counters.tokens - tokens_before == len(jobs.windows(first)[1].tokens)


def test_a_stored_window_is_used_as_it_is(engine4, jobs, speech, tiny):
    """Proof that nothing stored is decoded again: a marked window 0 comes back unchanged."""
    job_id = jobs.create(speech["long"], "whisper-tiny.en")
    marker = tiny.tokenizer.encode(" Stored before the crash.")
    jobs.add_window(job_id, 0, WindowResult(marker, 0.0, -0.1))
    transcript = run(engine4, jobs, job_id)
    assert transcript.segments[0].text == "Stored before the crash."
    assert len(transcript.segments) == 2 and "report" in transcript.segments[1].text.lower()


def test_windows_stored_for_other_windows_are_decoded_again(engine4, jobs, speech, tiny):
    """A crash, then a resume whose voice activity cuts the file elsewhere (another model version or
    settings): the stored window 0 belongs to other audio, so it is dropped and decoded again."""
    job_id = jobs.create(speech["long"], "whisper-tiny.en")
    marker = tiny.tokenizer.encode(" Stored before the crash.")
    jobs.started(job_id, 2, "en", 45.0, [[0, 1500], [1500, 3000]])  # the windows of the earlier run
    jobs.add_window(job_id, 0, WindowResult(marker, 0.0, -0.1))
    transcript = run(engine4, jobs, job_id)
    assert "Stored before the crash" not in transcript.text and "report" in transcript.text.lower()
    job = jobs.get(job_id)
    assert job.options["spans"] != [[0, 1500], [1500, 3000]]  # the windows it was decoded in now
    assert jobs.windows(job_id)[0].tokens == transcript.segments[0].tokens
    # A job from before spans were kept: only its window count is known, and it differs.
    old = jobs.create(speech["long"], "whisper-tiny.en")
    jobs.started(old, 5, "en", 45.0)
    for index in range(5):
        jobs.add_window(old, index, WindowResult(marker, 0.0, -0.1))
    again = run(engine4, jobs, old)
    assert "Stored before the crash" not in again.text and sorted(jobs.windows(old)) == [0, 1]


def test_failures_and_cancellation_touch_only_their_own_job(engine4, jobs, speech, tmp_path):
    bad = tmp_path / "noise.wav"
    bad.write_bytes(b"\x00\x01garbage" * 50)
    gone = tmp_path / "gone.wav"
    shutil.copy(speech["fox"], gone)
    ids = {name: jobs.create(path, "whisper-tiny.en") for name, path in
           [("fox", speech["fox"]), ("bad", bad), ("gone", gone), ("long", speech["long"]), ("report", speech["report"])]}
    gone.unlink()  # deleted after it was queued
    handles = {}
    for name, job_id in ids.items():
        try:
            handles[name] = submit_job(engine4, jobs, job_id)
        except CadenceError as exc:
            assert name == "gone" and "does not exist" in str(exc)
    long_handle = handles["long"]
    long_handle.cancel()
    outcomes = {}
    for name, handle in handles.items():
        try:
            outcomes[name] = settle_job(jobs, ids[name], handle).text
        except CadenceError as exc:
            outcomes[name] = str(exc)
    assert "fox" in outcomes["fox"].lower() and "report" in outcomes["report"].lower()
    states = {name: jobs.get(job_id).state for name, job_id in ids.items()}
    assert states == {"fox": "done", "bad": "failed", "gone": "failed", "long": "cancelled", "report": "done"}
    assert "noise.wav" in jobs.get(ids["bad"]).error
    assert {j.id for j in jobs.unfinished()} == set()
    jobs.requeue(ids["long"])
    assert [j.id for j in jobs.unfinished()] == [ids["long"]]
