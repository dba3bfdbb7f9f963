"""`cadence serve`'s audio routes: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``,
OpenAI's multipart shape (``file``, ``model``, ``language``, ``prompt``, ``temperature``,
``response_format`` = json | text | srt | verbose_json | vtt, ``timestamp_granularities[]``).

Each upload is written to the server's own folder and becomes a job in the server's own job store
(``<data>/server/jobs.sqlite``, apart from the app's queue), so its windows are recorded as they
finish, exactly as ``cadence transcribe`` records a file's; it decodes on the default path (windows
cut in pauses, each phrase timed) beside every other request. The upload is deleted once answered;
a client that goes away cancels its job. Any file the command line reads is taken (audio or video),
up to ``--max-audio-mb``."""

from __future__ import annotations

import os
import shutil
import time
import uuid
import zlib
from pathlib import Path

from fastapi import Request

from app.server_common import ApiError, refuse_if_longer
from engine.errors import CadenceError
from engine.processes import process_alive, process_mark

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
WHISPER_ALIAS = "whisper-1"  # what OpenAI's examples ask for: the first Whisper model served here
FRAMES_PER_SECOND = 100  # a job's window spans are kept in mel frames
ORPHAN_UPLOAD_S = 3600  # an upload folder no job names is removed at a server's start once this old


class AudioService:
    """The uploads folder and job store of one server's transcriptions."""

    def __init__(self, engine, models: list[str], max_bytes: int, folder: Path | None = None):
        from engine.jobs import JobStore
        from engine.paths import data_dir

        self.engine, self.models, self.max_bytes = engine, models, max_bytes
        self.folder = Path(folder or data_dir() / "server")
        self.uploads = self.folder / "uploads"
        self.uploads.mkdir(parents=True, exist_ok=True)
        self.jobs = JobStore(self.folder / "jobs.sqlite")
        self.recover()

    def recover(self) -> None:
        """A server that stopped mid-transcription left its jobs unfinished and its uploads behind: the jobs
        of servers no longer running are marked failed and their uploads removed. A server is known by its process
        id and start time, so a later process with the same id (a container restarted: the server is process 1
        every time) is not taken for it. Upload folders that no job names (a server stopped between saving an
        upload and queueing it) are removed once they are an hour old (a running server may be writing a new one)."""
        named = set()
        for job in self.jobs.unfinished():
            if _server_alive(job.options):
                named.add(Path(job.path).parent.name)
                continue
            self.jobs.failed(job.id, "The server stopped before this transcription finished.")
            folder = Path(job.path).parent
            if folder.parent.resolve() == self.uploads.resolve():  # only an upload's own folder is removed
                shutil.rmtree(folder, ignore_errors=True)
        for folder in self.uploads.iterdir():
            try:
                old = time.time() - folder.stat().st_mtime > ORPHAN_UPLOAD_S
            except OSError:
                continue
            if folder.is_dir() and folder.name not in named and old:
                shutil.rmtree(folder, ignore_errors=True)

    def model_for(self, name) -> str:
        if not isinstance(name, str) or not name:
            raise ApiError(400, "Name a model: 'model' must be a Whisper model GET /v1/models lists "
                                f"(or {WHISPER_ALIAS}).", param="model")
        if name == WHISPER_ALIAS and self.models:
            return self.models[0]
        if name not in self.models:
            raise ApiError(404, f"The model '{name}' does not transcribe here (GET /v1/models lists the models "
                                "served).", param="model", code="model_not_found")
        return name

    async def form(self, request) -> dict:
        """The multipart fields, the file as its UploadFile; ApiError for what cannot be read."""
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            raise ApiError(411, "Send the upload with a Content-Length header (chunked uploads are not taken).")
        # (the form's other fields take far less than 1 MB)
        await refuse_if_longer(request, self.max_bytes + (1 << 20), "The upload is larger than this server takes "
                               f"({self.max_bytes >> 20} MB; --max-audio-mb sets it).")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "Send the audio as multipart/form-data with a 'file' part, as OpenAI's audio API "
                                "takes it.")
        try:
            form = await request.form(max_files=1, max_fields=32)
        except Exception:  # starlette's multipart errors: a body that is not what its header says
            raise ApiError(400, "The upload is not valid multipart form data.") from None
        fields = {}
        for key, value in form.multi_items():
            key = key.removesuffix("[]")
            if key == "timestamp_granularities":
                fields.setdefault(key, []).append(value)
            else:
                fields[key] = value
        return fields

    def options(self, fields: dict, task: str) -> dict:
        """The job options a request's fields ask for (checked: ApiError for a bad one)."""
        fmt = fields.get("response_format") or "json"
        if fmt not in RESPONSE_FORMATS:
            raise ApiError(400, f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}.",
                           param="response_format")
        granularities = fields.get("timestamp_granularities", [])
        if any(g not in GRANULARITIES for g in granularities):
            raise ApiError(400, "'timestamp_granularities[]' may only hold segment and word.",
                           param="timestamp_granularities")
        if granularities and fmt != "verbose_json":
            raise ApiError(400, "'timestamp_granularities[]' needs response_format verbose_json.",
                           param="timestamp_granularities")
        temperature = fields.get("temperature")
        if temperature not in (None, ""):
            try:
                value = float(temperature)
            except (TypeError, ValueError):
                raise ApiError(400, "'temperature' must be a number.", param="temperature") from None
            if value != 0:
                raise ApiError(400, "Transcription here is greedy: 'temperature' must be 0 (the default).",
                               param="temperature")
        if str(fields.get("stream", "false")).lower() not in ("false", "0", ""):
            raise ApiError(400, "Transcriptions are answered whole here ('stream' must be false).", param="stream")
        for name in ("language", "prompt"):
            if name in fields and not isinstance(fields[name], str):
                raise ApiError(400, f"'{name}' must be text.", param=name)
        language = (fields.get("language") or None) if task == "transcribe" else None
        prompt = fields.get("prompt") or None
        return {"format": fmt, "task": task, "language": language, "timestamps": True,
                "words": "word" in granularities, **({"prompt": prompt} if prompt else {}),
                "server": process_mark()}

    async def save(self, upload) -> Path:
        """The upload written to a folder of its own under the uploads folder, by the name the client gave
        (so a sentence about the file names it as its owner knows it; the extension helps tell its format)."""
        import asyncio

        if not hasattr(upload, "filename") or not hasattr(upload, "file"):
            raise ApiError(400, "Attach the audio as the form's 'file' part.", param="file")
        size = upload.size if upload.size is not None else 0
        if size == 0:
            raise ApiError(400, f"The file {upload.filename or ''} is empty.".replace("  ", " "), param="file")
        if size > self.max_bytes:
            raise ApiError(413, f"The file is larger than this server takes ({self.max_bytes >> 20} MB; "
                                "--max-audio-mb sets it).", param="file")
        name = "".join(c if c.isalnum() or c in " ._-()" else "_" for c in Path(upload.filename or "").name)
        name = name.strip(" .")[-120:] or "audio"
        path = self.uploads / uuid.uuid4().hex / name

        def copy():
            path.parent.mkdir()
            upload.file.seek(0)
            with open(path, "wb") as out:
                shutil.copyfileobj(upload.file, out, 1 << 20)

        await asyncio.to_thread(copy)
        return path

    def answer(self, transcript, job_id: int, options: dict):
        """The response for a finished transcription, in the format asked."""
        from fastapi.responses import JSONResponse, PlainTextResponse

        from engine.formats import render

        fmt = options["format"]
        if fmt == "json":
            return JSONResponse({"text": transcript.text, "usage": {"type": "duration",
                                                                    "seconds": int(-(-transcript.duration // 1))}})
        if fmt == "text":
            return PlainTextResponse(transcript.text + "\n")
        if fmt in ("srt", "vtt"):
            return PlainTextResponse(render(transcript, fmt), media_type="text/vtt" if fmt == "vtt" else None)
        return JSONResponse(self.verbose(transcript, job_id, options))

    def verbose(self, transcript, job_id: int, options: dict) -> dict:
        """OpenAI's verbose_json: the segments with each one's window (seek), tokens and quality figures."""
        job = self.jobs.get(job_id)
        spans = job.options.get("spans") or []
        windows = self.jobs.windows(job_id)
        segments = []
        for i, s in enumerate(transcript.segments):
            index = max([w for w, (seek, _) in enumerate(spans) if seek / FRAMES_PER_SECOND <= s.start + 1e-6],
                        default=0)
            window = windows.get(index)
            data = s.text.encode("utf-8")
            segments.append({"id": i, "seek": spans[index][0] if spans else 0, "start": round(s.start, 3),
                             "end": round(s.end, 3), "text": s.text, "tokens": list(s.tokens), "temperature": 0.0,
                             "avg_logprob": window.avg_logprob if window else 0.0,
                             "compression_ratio": round(len(data) / max(1, len(zlib.compress(data))), 4),
                             "no_speech_prob": window.no_speech_prob if window else 0.0})
        out = {"task": options["task"], "language": transcript.language, "duration": round(transcript.duration, 3),
               "text": transcript.text, "segments": segments}
        if options["words"]:
            out["words"] = [{"word": w.text.strip(), "start": round(w.start, 3), "end": round(w.end, 3),
                             "probability": round(w.probability, 4)}  # (beyond OpenAI's fields, as faster-whisper's)
                            for s in transcript.segments for w in (s.words or [])]
        return out


def add_audio_routes(app, service) -> None:
    """POST /v1/audio/transcriptions and /v1/audio/translations on the server's app."""
    async def transcribe(request: Request, task: str):
        from engine.jobs import settle_job, submit_job

        service.check_key(request.headers.get("authorization"))
        audio: AudioService = service.audio
        fields = await audio.form(request)
        model = audio.model_for(fields.get("model"))
        options = audio.options(fields, task)
        service.admit()
        path = await audio.save(fields.get("file"))
        job_id = audio.jobs.create(path, model, options)
        try:
            try:
                handle = submit_job(service.engine, audio.jobs, job_id)
                transcript = await service.until_done(request, handle,
                                                      lambda: settle_job(audio.jobs, job_id, handle, model))
            except CadenceError as exc:  # the file's or the request's own sentence (recorded in the job too)
                raise ApiError(400, str(exc)) from None
        finally:
            shutil.rmtree(path.parent, ignore_errors=True)
        if transcript is None:  # the client went away; its job was cancelled
            from fastapi.responses import Response

            return Response(status_code=499)
        return audio.answer(transcript, job_id, options)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        return await transcribe(request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(request: Request):
        return await transcribe(request, "translate")


def _server_alive(options: dict) -> bool:
    """Whether the server that queued a job still runs: its mark (process id and start time), or, for a job queued
    by an earlier version, its bare process id (never this process's: this server has only just started)."""
    if "server" in options:
        return process_alive(options["server"])
    pid = options.get("server_pid")
    return isinstance(pid, int) and pid != os.getpid() and process_alive(f"{pid}:")
