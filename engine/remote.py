"""A remote engine: the engine's public face (``submit`` a request, follow its :class:`~engine.api.Handle`'s
events, ``status``, ``shutdown``) over an OpenAI-compatible server: another Cadence (``cadence serve``),
vLLM, or llama.cpp's server. The front ends drive it exactly as they drive the local :class:`Engine`, so
conversations are stored as they stream and transcriptions go through the job store the same way.

The protocol is the ``openai`` client's (its retries and timeouts): chats are streamed from
``/v1/chat/completions``; a transcription is uploaded whole to ``/v1/audio/transcriptions`` (or
``/translations``) and read back as ``verbose_json``. What a server cannot say (token ids, the slot a
request sat in) is left out rather than guessed. A server that drops mid-answer ends the request with a
``failed`` event after the text received so far, which the conversation store keeps, marked failed.
Recording (live transcription) and telling speakers apart need the local engine."""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.api import (
    ChatAnswer,
    ChatRequest,
    ChatStarted,
    Delta,
    DocumentChatRequest,
    Finished,
    Handle,
    LiveTranscribeRequest,
    PromptFitting,
    TranscribeRequest,
    TranscriptionStarted,
)
from engine.errors import CadenceError
from engine.transcript import Segment, Transcript, Word

CHAT_TIMEOUT_S = 600  # the longest wait for the next piece of an answer
TRANSCRIBE_TIMEOUT_S = 3 * 3600  # an upload is answered whole: hours of audio on a busy server
RETRIES = 2  # the client's own: connection errors, 408, 409, 429 and 5xx are tried again
MAX_REQUESTS = 64  # requests followed at once (each holds a thread while it streams)
PROBE_TIMEOUT_S = 3.0  # /slots and /metrics: a live panel asks often, so it never waits long
NOT_SERVED = (404, 405, 501)  # what a server answers for a route it does not have (llama.cpp: 501 with --no-slots)


def server_url(url: str) -> str:
    """The API's base URL from what a person types: ``host:port``, ``http://host:port`` or ``.../v1``."""
    url = (url or "").strip().rstrip("/")
    if not url:
        raise CadenceError("Give the server's address, such as http://127.0.0.1:8000.")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise CadenceError(f"{url} is not an http:// or https:// address.")
    return url if url.endswith("/v1") else url + "/v1"


def error_sentence(exc: Exception, url: str) -> str:
    """One sentence for what the server or the connection to it said."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        message = body.get("message") or (body.get("error") or {}).get("message") if body else None
        if exc.status_code == 401:
            return f"The server at {url} refused the API key (missing or wrong)."
        if exc.status_code == 404 and not message:
            return f"The server at {url} does not serve that (HTTP 404)."
        message = (message or str(exc)).strip().rstrip(".")
        if exc.status_code >= 500:  # the server's own failure: its words are not about the request
            return f"The server at {url} failed on this request (HTTP {exc.status_code}: {message})."
        return message + "."
    if isinstance(exc, openai.APITimeoutError):
        return f"The server at {url} did not answer in time."
    if isinstance(exc, openai.APIConnectionError):
        return f"The server at {url} could not be reached, or the connection to it was lost."
    return f"The server at {url} sent an answer Cadence cannot read ({exc.__class__.__name__})."


class RemoteEngine:
    """Requests answered by a server at ``url`` (``http://host:port`` or its ``/v1``)."""

    remote = True  # model names are the server's (see engine.chat.answering.Conversations)

    def __init__(self, url: str, api_key: str | None = None, timeout: float = CHAT_TIMEOUT_S,
                 retries: int = RETRIES):
        from openai import OpenAI

        self.url = server_url(url)
        self.device = f"server {self.url}"
        self.client = OpenAI(base_url=self.url, api_key=api_key or "none", timeout=timeout, max_retries=retries)
        self._pool = ThreadPoolExecutor(MAX_REQUESTS, thread_name_prefix="cadence-remote")
        self._open: dict[int, object] = {}  # handle id -> its open response stream (closed to cancel)
        self._lock = threading.Lock()
        self._stopped = False

    # the engine's public face ----------------------------------------------------------------
    def submit(self, request) -> Handle:
        if self._stopped:
            raise CadenceError("The engine has been shut down.")
        if isinstance(request, LiveTranscribeRequest):
            raise CadenceError("Recording needs the engine on this computer (live captions are not served over "
                               "the network).")
        if not isinstance(request, (ChatRequest, TranscribeRequest)):
            raise CadenceError(f"A server cannot answer a {type(request).__name__}.")
        handle = Handle(request, on_cancel=self.cancel)
        work = self._chat if isinstance(request, ChatRequest) else self._transcribe
        self._pool.submit(self._run, work, handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        handle.cancelled = True
        with self._lock:
            stream = self._open.get(handle.id)
        if stream is not None:
            try:  # closing the connection is how a server learns the client left (it frees the slot)
                stream.close()
            except Exception:
                pass

    def shutdown(self, timeout: float = 30) -> None:
        self._stopped = True
        with self._lock:
            streams = list(self._open.values())
        for stream in streams:
            try:
                stream.close()
            except Exception:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)

    def models(self) -> list[str]:
        """The names the server's ``/v1/models`` lists."""
        try:
            return [m.id for m in self.client.models.list().data]
        except Exception as exc:
            raise CadenceError(error_sentence(exc, self.url)) from None

    def slots(self) -> list[dict] | None:
        """The server's ``GET /slots`` (llama.cpp's shape: per slot ``id``, ``is_processing``, ``id_task``,
        ``n_ctx``, ``next_token.n_decoded``; a Cadence server adds ``model``, ``slot`` and ``drafting``), or
        None where the server has no such route (vLLM)."""
        answer = self._probe("/slots")
        if answer is None:
            return None
        try:
            data = answer.json()
        except ValueError:
            return None
        return [s for s in data if isinstance(s, dict)] if isinstance(data, list) else None

    def metrics(self) -> dict[str, list[tuple[dict, float]]] | None:
        """The server's ``GET /metrics`` (Prometheus text: a Cadence server's names under ``cadence:``, vLLM's
        under ``vllm:``, llama.cpp's under ``llamacpp:``) parsed with prometheus_client's parser: each sample's
        name (counters end in ``_total``, histograms in ``_sum`` / ``_count`` / ``_bucket``) -> its (labels,
        value) pairs; None where the server has no such route or sends something else."""
        from prometheus_client.parser import text_string_to_metric_families

        answer = self._probe("/metrics")
        if answer is None:
            return None
        out: dict[str, list[tuple[dict, float]]] = {}
        try:
            for family in text_string_to_metric_families(answer.text):
                for sample in family.samples:
                    out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        except (ValueError, TypeError, IndexError):  # not Prometheus text (an HTML page at that address)
            return None
        return out

    def _probe(self, route: str):
        """GET a route beside ``/v1`` with the key as a Bearer header and a short timeout: the response, or None
        where the server does not have it; CadenceError (one sentence) when the server cannot be asked."""
        try:
            import httpx2 as httpx  # what the openai client is built on here
        except ImportError:
            import httpx

        url = self.url[: -len("/v1")] + route
        headers = {"Authorization": f"Bearer {self.client.api_key}"}  # ('none' without a key, as the client sends)
        try:
            answer = httpx.get(url, headers=headers, timeout=PROBE_TIMEOUT_S)
        except httpx.TimeoutException:
            raise CadenceError(f"The server at {self.url} did not answer in time.") from None
        except httpx.HTTPError:
            raise CadenceError(f"The server at {self.url} could not be reached.") from None
        if answer.status_code in NOT_SERVED:
            return None
        if answer.status_code in (401, 403):
            raise CadenceError(f"The server at {self.url} refused the API key (missing or wrong).")
        if answer.status_code >= 400:
            raise CadenceError(f"The server at {self.url} answered {route} with HTTP {answer.status_code}.")
        return answer

    def status(self) -> dict:
        """What the engine panel and the command line read; a server's slots are not known here."""
        return {"backend": self.device, "backend_name": f"a server at {self.url}", "batch": None,
                "batch_from": "the server", "drafter": None, "precision": None, "context": None, "lanes": {}}

    # following one request (a pool thread) ---------------------------------------------------
    def _run(self, work, handle: Handle) -> None:
        try:
            work(handle)
        except CadenceError as exc:
            handle.fail(str(exc))
        except Exception as exc:
            if handle.cancelled:
                handle.fail("Cancelled.")
            else:
                handle.fail(error_sentence(exc, self.url))
        finally:
            with self._lock:
                self._open.pop(handle.id, None)

    def _chat(self, handle: Handle) -> None:
        request: ChatRequest = handle.request
        if request.prompt_ids is not None:
            raise CadenceError("A prompt given as token ids needs the engine on this computer.")
        started = time.perf_counter()
        stream, parts = self._open_fitted(handle, request)
        fitting = PromptFitting(document_parts=parts, system=request.system_for(parts) if parts is not None else None)
        handle.emit(ChatStarted(handle.id, fitting=fitting))
        text, first, usage, reason = [], None, None, None
        try:
            for chunk in stream:
                if handle.cancelled:
                    break
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    piece = choice.delta.content if choice.delta else None
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
                        handle.emit(Delta(handle.id, text=piece))
                    reason = choice.finish_reason or reason
        except Exception:
            if not handle.cancelled:  # the connection failed; a stream closed by cancel() ends the answer below
                raise
        if handle.cancelled:
            reason = "cancelled"
        elif reason is None:
            raise CadenceError(f"The connection to the server at {self.url} ended before the answer did.")
        ended = time.perf_counter()
        # a server that sends no usage (llama.cpp's) sends a token per piece: counted from them
        tokens = usage.completion_tokens if usage is not None else len(text)
        stats = {"prompt_tokens": usage.prompt_tokens if usage is not None else None, "tokens": tokens,
                 "time_to_first_token": round(first - started, 4) if first else None,
                 "end_to_end": round(ended - started, 4), "seconds": round(ended - started, 4),
                 "tok_s": round(tokens / (ended - started), 1) if tokens else 0.0, "server": self.url}
        fitting.prompt_tokens = stats["prompt_tokens"] or 0
        answer = ChatAnswer("".join(text), [], "length" if reason == "length" else
                            ("cancelled" if reason == "cancelled" else "stop"), stats, fitting)
        handle.emit(Finished(handle.id, answer=answer))

    def _open_chat(self, handle: Handle, request: ChatRequest, parts: int | None):
        """The streamed response of a chat request (the system prompt holding ``parts`` of a document)."""
        system = request.system_for(parts) if parts is not None else request.system
        messages = ([{"role": "system", "content": system}] if system else []) + list(request.history) + \
            [{"role": "user", "content": request.prompt}]
        p = request.params
        extra = {k: v for k, v in (("top_k", p.top_k), ("min_p", p.min_p),
                                   ("repetition_penalty", p.repetition_penalty))
                 if v != {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}[k]}
        stream = self.client.chat.completions.create(
            model=request.model, messages=messages, stream=True, stream_options={"include_usage": True},
            temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens, stop=p.stop or None, seed=p.seed,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            **({"extra_body": extra} if extra else {}))
        with self._lock:
            self._open[handle.id] = stream
        if handle.cancelled:
            stream.close()
        return stream

    def _open_fitted(self, handle: Handle, request: ChatRequest):
        """The open stream and, for a document chat, how many of the document's parts its system prompt holds:
        all of them, or where the server says the prompt passes its context, half as many, until it fits (the
        server knows its own context; none at all is the last try)."""
        import openai

        parts = request.parts if isinstance(request, DocumentChatRequest) else None
        while True:
            try:
                return self._open_chat(handle, request, parts), parts
            except openai.BadRequestError as exc:
                sentence = error_sentence(exc, self.url).lower()
                if not parts or not any(word in sentence for word in ("context", "token")):
                    raise
                parts //= 2

    def _transcribe(self, handle: Handle) -> None:
        import numpy as np

        request: TranscribeRequest = handle.request
        if request.speakers not in ("off", None):
            raise CadenceError("Telling speakers apart needs the engine on this computer.")
        started = time.perf_counter()
        handle.emit(TranscriptionStarted(handle.id, language=request.language, total=1))
        with tempfile.TemporaryDirectory(prefix="cadence-upload-") as folder:
            if isinstance(request.audio, np.ndarray):
                import soundfile

                path = Path(folder) / f"{Path(request.name or 'audio').stem or 'audio'}.wav"
                soundfile.write(str(path), request.audio, 16000)
            else:
                path = Path(request.audio)
                if not path.exists():
                    raise CadenceError(f"{path.name} does not exist (or was moved or deleted).")
            granularities = ["segment"] + (["word"] if request.words else [])
            options = {"model": request.model, "response_format": "verbose_json",
                       "timestamp_granularities": granularities, "timeout": TRANSCRIBE_TIMEOUT_S}
            if request.initial_prompt:
                options["prompt"] = request.initial_prompt
            with open(path, "rb") as f:
                if request.task == "translate":
                    answer = self.client.audio.translations.create(file=(path.name, f), **options)
                else:
                    answer = self.client.audio.transcriptions.create(file=(path.name, f), language=request.language,
                                                                     **options)
        if handle.cancelled:
            raise CadenceError("Cancelled.")
        handle.emit(Finished(handle.id, transcript=self._transcript(answer, request, started)))

    def _transcript(self, answer, request: TranscribeRequest, started: float) -> Transcript:
        """A verbose_json answer as the engine's Transcript (words shared out to their segments)."""
        data = answer.model_dump() if hasattr(answer, "model_dump") else dict(answer)
        segments = [Segment(float(s["start"]), float(s["end"]), str(s["text"]).strip(), list(s.get("tokens") or []))
                    for s in data.get("segments") or []]
        if request.words:
            for segment in segments:
                segment.words = []
            for w in data.get("words") or []:  # each word to the last segment starting at or before it
                word = Word(float(w["start"]), float(w["end"]), " " + str(w["word"]).strip(),
                            float(w.get("probability") or 0.0))  # (a Cadence server sends it; OpenAI does not)
                owners = [s for s in segments if s.start <= word.start + 1e-3] or segments[:1]
                if owners:
                    owners[-1].words.append(word)
        seconds = time.perf_counter() - started
        duration = float(data.get("duration") or 0.0)
        n_tokens = sum(len(s.tokens) for s in segments)
        name = str(request.audio) if not hasattr(request.audio, "shape") else (request.name or "audio")
        return Transcript(file=name, text=str(data.get("text") or "").strip(), language=data.get("language"),
                          duration=duration, segments=segments,
                          stats={"tokens": n_tokens, "seconds": round(seconds, 3),
                                 "tok_s": round(n_tokens / seconds, 1) if seconds > 0 else 0.0,
                                 "realtime_factor": round(duration / seconds, 1) if seconds > 0 else 0.0,
                                 "server": self.url})
