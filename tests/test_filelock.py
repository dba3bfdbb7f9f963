"""Cache work is done by one process at a time: two processes filling the same cache entry at once
(the app and the command line started together, or two test workers) take turns, and the second
sees what the first wrote."""

import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from engine.filelock import held

    counter = Path(sys.argv[1])
    with held(counter):
        seen = int(counter.read_text()) if counter.exists() else 0
        time.sleep(0.5)  # both processes are inside here at once unless the lock holds one back
        counter.write_text(str(seen + 1))
""")


def test_two_processes_take_turns_and_the_second_sees_the_first(tmp_path):
    counter = tmp_path / "counter"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(counter)]) for _ in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    assert counter.read_text() == "2"  # without the lock both read 0 and both wrote 1


def test_a_recorded_choice_is_measured_once(tmp_path, monkeypatch):
    from engine import kernels

    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    measured = []

    def measure():
        measured.append(1)
        return [4, 8]

    def valid(value):
        return isinstance(value, list)

    assert kernels.recorded_choice("test-choice", measure, valid) == [4, 8]
    assert kernels.recorded_choice("test-choice", measure, valid) == [4, 8]
    assert measured == [1]
