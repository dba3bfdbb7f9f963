"""``cadence transcribe``: files and folders in, transcripts out, every file a job in the store.

Each input becomes a job in the SQLite store before decoding starts, and its windows are recorded
as they finish, so ``cadence transcribe --resume`` after a crash or a kill continues every
unfinished job without decoding its finished windows again. All jobs are submitted to the engine
at once, so files decode side by side; outputs are written in input order: next to each input by
default, into ``--out DIR``, or to stdout with ``--out -``. ``--json`` prints one JSON list.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from app.cli.common import (
    NoSession,
    Session,
    check_model,
    engine_options,
    err,
    expand_inputs,
    parse_batch,
    remote_model,
    remote_server,
)
from engine.errors import CadenceError


def add_transcript_flags(p) -> None:
    """Speakers, word timestamps and subtitle rules (``cadence transcribe``)."""
    from engine.subtitles import SubtitleRules

    d = SubtitleRules()
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="text that steers every window: names and spellings to use, a style to follow "
                        "(read by the model as if it had been said just before)")
    p.add_argument("--speakers", default="off", metavar="auto|N|off",
                   help="tell speakers apart: auto (count them), N (that many) or off (default); segments and "
                        "outputs carry each speaker's label")
    p.add_argument("--word-timestamps", dest="words", action="store_true",
                   help="time each word too (JSON carries 'words'; subtitles are cut at word times)")
    p.add_argument("--max-line-chars", type=int, default=d.max_chars, metavar="N",
                   help=f"subtitles: characters per line (default {d.max_chars})")
    p.add_argument("--max-lines", type=int, default=d.max_lines, metavar="N",
                   help=f"subtitles: lines per cue (default {d.max_lines})")
    p.add_argument("--min-cue-duration", type=float, default=d.min_duration, metavar="S",
                   help=f"subtitles: seconds a cue stays on screen at least (default {d.min_duration:.2f})")
    p.add_argument("--max-cue-duration", type=float, default=d.max_duration, metavar="S",
                   help=f"subtitles: seconds a cue stays on screen at most (default {d.max_duration:g})")


def transcript_options(args) -> dict:
    """The job options the transcript flags give, checked (a bad value is one sentence)."""
    from engine.speakers import parse_speakers
    from engine.subtitles import SubtitleRules

    try:
        speakers = parse_speakers(args.speakers)
    except CadenceError as exc:
        raise CadenceError(f"--speakers: {exc}") from None
    rules = SubtitleRules(max_chars=args.max_line_chars, max_lines=args.max_lines,
                          min_duration=args.min_cue_duration, max_duration=args.max_cue_duration)
    return {"speakers": speakers, "words": args.words, "subtitles": rules.to_options(),
            **({"prompt": args.prompt} if args.prompt and args.prompt.strip() else {})}


def _target(job, fmt: str) -> Path | None:
    """Where a job's output goes: None for stdout."""
    out = job.options.get("out")
    if out == "-":
        return None
    folder = Path(out).expanduser() if out else Path(job.path).parent
    return folder / f"{Path(job.path).stem}.{fmt}"


def _overwrite_refusal(job, target: Path | None) -> str | None:
    """The one sentence refusing an output that would replace a file the user did not let go; None if it may
    be written."""
    if target is not None and target.exists() and not job.options.get("overwrite"):
        return f"{target} already exists (use --overwrite to replace it)."
    return None


def _follow(session: Session, handle, name: str, show_progress: bool) -> None:
    shown = False
    for event in session.follow(handle):
        if show_progress and event.kind == "progress" and event.total > 1:
            sys.stderr.write(f"\r{name}: window {event.done}/{event.total}\033[K")
            sys.stderr.flush()
            shown = True
    if shown:
        sys.stderr.write("\r\033[K")


def cmd_transcribe(args) -> int:
    from engine.formats import render
    from engine.jobs import JobStore, settle_job, submit_job
    from engine.models import DEFAULT_WHISPER, WHISPER
    from engine.subtitles import SubtitleRules

    if args.json and args.format not in (None, "json"):
        raise CadenceError(f"--json prints JSON; it cannot be combined with --format {args.format}.")
    fmt = "json" if args.json else (args.format or "txt")
    server = remote_server(args)
    batch = parse_batch(args.batch)
    engine_opts = engine_options(args)
    jobs = JobStore()
    if not args.files and not args.resume:
        raise CadenceError("Give audio files or folders to transcribe, or --resume to continue unfinished jobs.")
    ids: list[int] = []
    if args.resume:
        ids += [job.id for job in jobs.unfinished()]
        err(f"Resuming {len(ids)} unfinished job{'s' if len(ids) != 1 else ''}.")
    if args.files:
        extra = transcript_options(args)
        if server is not None:
            if extra["speakers"] != "off":
                raise CadenceError("--speakers needs the engine on this computer; a server does not tell speakers apart.")
            model = remote_model(server, args.model, whisper=True)
        else:
            model = check_model(args.model or DEFAULT_WHISPER, WHISPER).name
        files = expand_inputs(args.files)
        if not files:
            raise CadenceError("No audio files were found in what was given.")
        out = args.out
        if out and out != "-":
            try:
                Path(out).expanduser().mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CadenceError(f"The output folder {out} cannot be created ({exc.strerror or exc}).") from None
        options = {"format": fmt, "out": out if not (args.json and not out) else "-", "overwrite": args.overwrite,
                   "language": args.language, "task": args.task, "windowing": args.windows,
                   "timestamps": args.timestamps, **extra}
        ids += [jobs.create(path.absolute(), model, options) for path in files]
    if not ids:
        return 0

    show_progress = sys.stderr.isatty()
    entries, failed = [], 0
    wanted = []
    for job_id in ids:  # refuse what cannot be written before an engine starts or anything is decoded
        job = jobs.get(job_id)
        refusal = _overwrite_refusal(job, _target(job, job.options.get("format", fmt)))
        if refusal:
            jobs.failed(job_id, refusal)
        else:
            wanted.append(job_id)
    with Session(args.backend, batch, engine_opts, server) if wanted else NoSession() as session:
        handles = {}
        for job_id in wanted:
            try:
                handles[job_id] = submit_job(session.engine, jobs, job_id)
                session.handles.append(handles[job_id])
            except CadenceError as exc:
                jobs.failed(job_id, str(exc))
        for job_id in ids:
            job = jobs.get(job_id)
            job_fmt = job.options.get("format", fmt)
            name = Path(job.path).name
            try:
                if job_id not in handles:
                    raise CadenceError(job.error or f"{name} could not be started.")
                _follow(session, handles[job_id], name, show_progress)
                transcript = settle_job(jobs, job_id, handles[job_id], job.model)
                s = transcript.stats
                err(f"{job.path}: {s['tokens']} tokens in {s['seconds']:.2f} s "
                     f"({s['tok_s']} tok/s, {s['realtime_factor']}x real time)")
                entry = transcript.to_json() | {"file": job.path, "model": job.model, "job": job_id}
                target = _target(job, job_fmt)
                refusal = _overwrite_refusal(job, target)  # two inputs with the same name
                if refusal:
                    raise CadenceError(refusal)
                rules = SubtitleRules.from_options(job.options.get("subtitles"))
                if target is not None:
                    target.write_text(render(transcript, job_fmt, rules), encoding="utf-8")
                    entry["output"] = str(target)
                elif job_fmt != "json":
                    sys.stdout.write(render(transcript, job_fmt, rules))
                    sys.stdout.flush()
            except CadenceError as exc:
                failed += 1
                entry = {"file": job.path, "job": job_id, "error": str(exc)}
                err(f"{job.path}: {exc}")
            except OSError as exc:  # writing the output failed
                failed += 1
                entry = {"file": job.path, "job": job_id,
                         "error": f"The output for {name} could not be written ({exc.strerror or exc})."}
                jobs.failed(job_id, entry["error"])
                err(f"{job.path}: {entry['error']}")
            entries.append(entry)
        elapsed = session.elapsed()
        note = session.width_note(args.model or DEFAULT_WHISPER)
    if args.json:
        print(json.dumps(entries, ensure_ascii=False, indent=2))
    err(f"{len(ids) - failed} of {len(ids)} file{'s' if len(ids) != 1 else ''} transcribed in {elapsed:.2f} s{note}.")
    return 1 if failed else 0
