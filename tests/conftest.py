"""Shared fixtures: real models loaded once per session, real speech generated with espeak-ng."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

# Keep the user's own cache and data out of the suite: every run converts the models once, in a
# cache of its own, which also exercises the cold path. The workers of `make test` share the run's
# cache (conversions and calibrations are locked, so one worker makes each and the others wait and
# read it, as two Cadence processes on one machine do), but each keeps data folders of its own.
_SESSION_ROOT = Path(tempfile.mkdtemp(prefix="cadence-tests-"))
_RUN_CACHE = "CADENCE_TEST_RUN_CACHE"  # set by the first process of a run, inherited by its workers
if not os.environ.get(_RUN_CACHE):
    os.environ[_RUN_CACHE] = os.environ.get("CADENCE_CACHE_DIR") or str(_SESSION_ROOT / "cache")
os.environ["CADENCE_CACHE_DIR"] = os.environ[_RUN_CACHE]
if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `make test`: its own data, not the controller's
    os.environ["CADENCE_DATA_DIR"] = str(_SESSION_ROOT / "data")
os.environ.setdefault("CADENCE_DATA_DIR", str(_SESSION_ROOT / "data"))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's yardstick is float32: the exactness tests against transformers and faster-whisper run in it,
# and so does every engine a test does not give a precision (tests/test_precision.py covers the others).
os.environ.setdefault("CADENCE_PRECISION", "float32")
# `make test` runs the files on as many workers as the machine has cores (pytest-xdist): each worker,
# and each command-line process a test starts, then computes on its share of the cores, not on all.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_name] = _THREADS

from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

import engine.calibration  # noqa: E402
from engine.backend import return_freed_memory  # noqa: E402

# A width calibration (and precision auto) times its first width again at the end and keeps nothing it
# measured while the machine got busier in between: the next engine start measures again. In the suite
# the other worker makes the machine busier at random, so a third of the calibrations came out
# "unsteady" and every later engine on that model measured again (a run measured 17 curves, 105 s of
# work, about half of it repeats). Here whatever is measured is kept; the rule's own tests
# (test_engine_operations, test_precision) set the shipped factor back, SHIPPED_UNSTEADY.
SHIPPED_UNSTEADY = engine.calibration.UNSTEADY
engine.calibration.UNSTEADY = float("inf")

SPEECH = {
    "fox": ("en-us+f3", 130, "The quick brown fox jumps over the lazy dog. Meetings start at nine in the morning."),
    "report": ("en-us+m3", 150, "Please remember to send the quarterly report to the finance team by Friday afternoon."),
    "budget": ("en-us+f3", 140, "We will review the budget numbers together next week and decide on the new hires."),
    "weather": ("en-us+m3", 135, "Tomorrow will be cloudy with a chance of rain in the afternoon, so bring an umbrella."),
    "german": ("de", 130, "Guten Morgen. Heute besprechen wir den Plan für die nächste Woche und die neuen Aufgaben."),
}


# The files that take longest, longest first (measured with `make test`'s --durations on 2 cores).
# `make test` hands each file whole to the next free worker in this order, so the long ones start
# first and the short ones fill in around them, rather than one long file starting last while the
# other worker sits idle. (pytest-xdist would otherwise reorder the files by their number of tests,
# most first, and start this hour of speech late: the Makefile passes --no-loadscope-reorder.)
LONGEST_FIRST = ("test_longform.py", "test_cli.py", "test_drafting.py", "test_whisper_parity.py",
                 "test_conversations.py", "test_precision.py", "test_cli_transcribe.py", "test_families.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# A worker that dies in C code (a segfault in a decoder, say) is reported by pytest-xdist only as
# "worker crashed while running X"; its Python traceback goes to its own stderr, which CI shows only
# the end of. So each worker's fatal-error traceback is written to a file of the run, and the main
# process prints the crashing thread's frames last, where the end of the output shows them.
_CRASH_DIR = "CADENCE_TEST_CRASH_DIR"  # set by the first process of a run, inherited by its workers
if not os.environ.get(_CRASH_DIR):
    os.environ[_CRASH_DIR] = str(_SESSION_ROOT / "crashes")
_CRASH_REPORTS: list[str] = []


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler set-up, which writes to stderr
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    folder = Path(os.environ[_CRASH_DIR])
    folder.mkdir(parents=True, exist_ok=True)  # (the memory logs below go there too)
    if worker:
        config._cadence_crash_log = open(folder / f"{worker}.txt", "w")  # kept open for the whole run
        faulthandler.enable(config._cadence_crash_log, all_threads=True)


def _crash_summary(text: str) -> str:
    """The fatal error's first line and the crashing thread's frames, from a faulthandler dump."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:
        return "\n".join(lines[:40])
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return "\n".join([lines[0], *lines[start:min(end, start + 13)]])  # its 12 innermost frames


# Two workers share the machine's memory, and a worker's session fixtures keep what they load: one run
# lost a worker to the kernel's out-of-memory killer. So each worker writes its resident memory after every
# test (from /proc, where there is one), and the summary names each worker's peak and the files that
# added most, to show where the memory goes before it runs out. After each test the allocator's free pages
# are returned, and after each file the reference cycles collected first (engine.backend.return_freed_memory):
# that alone took tests/test_drafting.py's peak from 9.1 to 3.4 GiB, and what it left behind from 6.5 to 1.0.
_MEMORY_SUMMARY: list[str] = []
_STARTED = float(os.environ.setdefault("CADENCE_TEST_RUN_STARTED", f"{time.time():.3f}"))  # the first process's start, inherited


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # (a teardown hook runs only in the process that ran the test, after its fixtures' teardown; xdist's
    # controller, which runs none, writes nothing)
    # what the test dropped is not counted against the next; cycles are collected after each file (a full
    # collection takes 0.2 s here: after every test it cost the suite over a minute)
    return_freed_memory(collect=nextitem is None or nextitem.module is not item.module)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    rss = _resident_bytes()
    if rss is not None:
        with open(Path(os.environ[_CRASH_DIR]) / f"{worker}.memory", "a") as f:
            f.write(f"{rss} {time.time():.3f} {item.nodeid}\n")


def _memory_summary(folder: Path) -> list[str]:
    """Each worker's peak resident memory after a test, and the test files that added most to it; each
    worker's busy time (from its start to its last test) and the test files that took longest."""
    lines, grew, took = [], {}, {}
    for log_file in sorted(folder.glob("*.memory")):
        rows = [(int(n), float(t), node) for n, t, node in
                (line.split(" ", 2) for line in log_file.read_text().splitlines())]
        if not rows:
            continue
        peak, _, at = max(rows)
        lines.append(f"{log_file.stem}: peak {peak / 2**30:.1f} GiB after {at}, {rows[-1][0] / 2**30:.1f} GiB "
                     f"at the end; {rows[-1][1] - _STARTED:.0f} s from the run's start to its last test")
        before, then = rows[0][0], _STARTED  # (what the process held after its first test is not charged to a file)
        for n, t, node in rows:
            name = node.split("::", 1)[0]
            grew[name] = grew.get(name, 0) + n - before
            took[name] = took.get(name, 0.0) + t - then
            before, then = n, t
    if not grew:
        return lines
    top = sorted(grew.items(), key=lambda kv: -kv[1])[:6]
    lines.append("most added by: " + ", ".join(f"{name} {n / 2**30:+.1f} GiB" for name, n in top))
    slow = sorted(took.items(), key=lambda kv: -kv[1])[:8]
    lines.append("longest files (their tests, fixtures and waits): " + ", ".join(f"{name} {t:.0f} s" for name, t in slow))
    return lines


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = Path(os.environ[_CRASH_DIR])
        for log_file in sorted(folder.glob("*.txt")):
            text = log_file.read_text(errors="replace").strip()
            if text:
                _CRASH_REPORTS.append(f"{log_file.stem}: {_crash_summary(text)}")
        if folder.is_dir():
            _MEMORY_SUMMARY.extend(_memory_summary(folder))
    shutil.rmtree(_SESSION_ROOT, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    for report in _CRASH_REPORTS:
        terminalreporter.write_sep("=", "a test worker crashed in native code")
        terminalreporter.write_line(report)
    if _MEMORY_SUMMARY:
        terminalreporter.write_sep("-", "memory and time of each test process")
        for line in _MEMORY_SUMMARY:
            terminalreporter.write_line(line)


@contextlib.contextmanager
def file_restored(path: Path):
    """The file at ``path`` (or its absence) as it was before the block, whatever the block wrote there."""
    kept = path.read_text() if path.is_file() else None
    try:
        yield path
    finally:
        if kept is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(kept)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION_ROOT


def synthesize(text: str, out: Path, voice: str = "en-us+f3", rate: int = 130, sample_rate: int = 16000) -> Path:
    """Speak ``text`` with espeak-ng and convert it to a mono WAV at ``sample_rate`` (the same bytes in every
    run: -R seeds sox's dither)."""
    raw = out.with_suffix(".raw.wav")
    subprocess.run(["espeak-ng", "-w", str(raw), "-v", voice, "-s", str(rate), text], check=True)
    subprocess.run(["sox", "-R", str(raw), "-r", str(sample_rate), "-c", "1", str(out)], check=True)
    raw.unlink()
    return out


@pytest.fixture(scope="session")
def speech(session_dir) -> dict[str, Path]:
    """Short speech clips by name, plus 'long': about 45 s of speech spanning two 30-s windows."""
    folder = session_dir / "speech"
    folder.mkdir()
    clips = {name: synthesize(text, folder / f"{name}.wav", voice, rate) for name, (voice, rate, text) in SPEECH.items()}
    long_path = folder / "long.wav"
    parts = [str(clips[n]) for n in ("fox", "report", "budget", "weather", "fox", "report")]
    subprocess.run(["sox", *parts, str(long_path)], check=True)
    clips["long"] = long_path
    return clips


@pytest.fixture(scope="session")
def tiny():
    from engine.loading import load

    return load("whisper-tiny.en")


@pytest.fixture(scope="session")
def base():
    from engine.loading import load

    return load("whisper-base")


@pytest.fixture(scope="session")
def smollm():
    from engine.loading import load

    return load("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def engine4():
    """A running engine with 4 slots per lane, shared by the suite (models load once). Its chat slots
    hold 1024 tokens (smollm2's own context is 8192), so the tests that overflow a slot stay short: each
    prompt near a slot's length is prefilled in float32 by the engine and again by the reference (at 2048
    the two overflow tests took 75 s of a 2-core machine)."""
    from engine import Engine

    eng = Engine(backend="cpu", batch=4, precision="float32", context=1024)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_off():
    """The exact single-stream path: batching off."""
    from engine import Engine

    eng = Engine(backend="cpu", batch="off", precision="float32")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def chat_ref(smollm):
    from engine.chat.reference import ChatReference

    return ChatReference(smollm)


@pytest.fixture(scope="session")
def ct2_folder(session_dir):
    """A plain CTranslate2 folder for each built-in Whisper (parts joined), for faster-whisper."""
    from engine.models import resolve

    def make(name: str) -> Path:
        source = resolve(name)
        if len(source.weights) == 1:
            return source.folder
        folder = session_dir / f"ct2-{name}"
        if not folder.exists():
            folder.mkdir()
            with open(folder / "model.bin", "wb") as out:
                for part in source.weights:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out)
            for f in ("config.json", "tokenizer.json", "vocabulary.txt"):
                shutil.copy(source.folder / f, folder / f)
        return folder

    return make


@pytest.fixture(scope="session")
def faster_whisper(ct2_folder):
    """faster-whisper's float32 model for each built-in Whisper, loaded once, on this worker's share of
    the cores (its default takes them all, which only slows the other worker)."""
    import torch
    from faster_whisper import WhisperModel

    models = {}

    def get(name: str):
        if name not in models:
            models[name] = WhisperModel(str(ct2_folder(name)), device="cpu", compute_type="float32",
                                        cpu_threads=torch.get_num_threads())
        return models[name]

    return get

