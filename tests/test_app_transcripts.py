"""The viewer with speakers and words: two voices get two speakers shown per line, renaming one
renames every line of it (kept, and used by exports), and the word being played is highlighted."""

import numpy as np
import soundfile as sf
from app_support import app_home, open_window, wait_jobs_settled  # noqa: F401
from conftest import synthesize

from app.transcript_view import SPEAKER
from engine.audio import SAMPLE_RATE, load_audio

LINES = [("en-us+f3", "Good morning everyone, thanks for joining the call today."),
         ("en-us+m3", "Thanks for having me, I have the numbers ready."),
         ("en-us+f3", "Great, let us start with the sales figures for March."),
         ("en-us+m3", "Sales grew by twelve percent compared to February.")]


def test_speakers_are_shown_renamed_everywhere_and_words_followed(qtbot, app_home, tmp_path):  # noqa: F811
    parts = []
    for i, (voice, line) in enumerate(LINES):
        parts += [load_audio(synthesize(line, tmp_path / f"line{i}.wav", voice, 150)), np.zeros(6400, np.float32)]
    path = tmp_path / "meeting.wav"
    sf.write(path, np.concatenate(parts), SAMPLE_RATE)
    window = open_window(qtbot, app_home(speakers="auto", word_timestamps=True))
    [job_id] = window.bridge.add_paths([path])
    wait_jobs_settled(qtbot, window, timeout=300)
    view = window.transcript
    assert view.show_job(job_id)
    assert not view.table.isColumnHidden(SPEAKER)
    shown = [view.table.item(r, SPEAKER).text() for r in range(view.table.rowCount())]
    assert set(shown) == {"Speaker 1", "Speaker 2"}
    view.rename_speaker("S1", "Alice")
    shown_after = [view.table.item(r, SPEAKER).text() for r in range(view.table.rowCount())]
    assert shown_after == ["Alice" if s == "Speaker 1" else s for s in shown]
    assert window.bridge.jobs.get(job_id).result["speaker_names"] == {"S1": "Alice"}  # kept
    exported = view.export_to(tmp_path / "meeting.srt")
    assert "[Alice]" in exported.read_text() and "[Speaker 2]" in exported.read_text()
    assert view.follow_words.isEnabled()
    first = view.result["segments"][0]["words"]
    row, word = view.highlight_at(first[1]["start"] + 0.01)
    assert (row, word) == (0, 1) and f"<u>{first[1]['word']}</u>" in view.now_playing.text()
