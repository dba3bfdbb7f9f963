"""`cadence serve`: the engine behind an OpenAI-compatible HTTP API (FastAPI), for other programs
(editors, scripts, chat front ends) and for a Cadence on another machine.

It serves ``GET /health`` (503 while the models load, then 200), ``GET /v1/models``, ``GET /slots``
(llama.cpp's shape), ``GET /metrics`` (Prometheus, vLLM's names under ``cadence:``; app/server_metrics.py),
``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (server-sent events ending with
``data: [DONE]``) or not, and ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``
(app/server_audio.py). Every request shares the engine's lanes with every other: many clients decode
side by side in one batch. A client that goes away has its request cancelled, which frees its slot.
Errors are OpenAI's JSON shape with one sentence; no traceback leaves the server.

Safe by default: it binds to 127.0.0.1; another address needs an API key (``--api-key`` or
``CADENCE_API_KEY``), which every ``/v1`` route, ``/slots`` and ``/metrics`` then check (constant-time).
Bounded: request bodies (4 MB) and uploads (``--max-audio-mb``) have a size limit (413), and beyond
``--max-waiting`` requests waiting for a slot, a new one is turned away (429 with ``Retry-After``)."""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from app.server_common import ApiError, refuse_if_longer
from app.server_limits import DEFAULT_MAX_AUDIO_MB, DEFAULT_MAX_WAITING
from engine.errors import CadenceError, RequestError

MAX_BODY_BYTES = 4 << 20  # a chat request far larger than any context a model here takes
ROLES = ("system", "developer", "user", "assistant")


def check_model(model, models: list[str]) -> str:
    if not isinstance(model, str) or not model:
        raise ApiError(400, "Name a model: 'model' must be one of the names GET /v1/models lists.", param="model")
    if model not in models:
        raise ApiError(404, f"The model '{model}' is not served here (GET /v1/models lists those that are).",
                       param="model", code="model_not_found")
    return model


def chat_request(body: dict, models: list[str]):
    """The engine's :class:`~engine.api.ChatRequest` for an OpenAI chat-completions body (or ApiError)."""
    from engine.api import ChatRequest

    model = check_model(body.get("model"), models)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects.", param="messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}.",
                           param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}] may only hold text parts.", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be text.", param=f"messages[{i}].content")
        turns.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    system = turns.pop(0)["content"] if turns[0]["role"] == "system" else None
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "The last message must be the user's: it is the one answered.", param="messages")
    if any(t["role"] == "system" for t in turns):
        raise ApiError(400, "A system message may only come first.", param="messages")
    params = sampling_params(body)
    return ChatRequest(turns[-1]["content"], system=system, history=turns[:-1], model=model, params=params)


def sampling_params(body: dict):
    """The engine's SamplingParams for a body's OpenAI fields: their types checked here (each wrong one named),
    their values by the engine's own rule (engine.chat.store.sampling_params)."""
    from engine.chat.store import sampling_params as engine_params

    def number(name: str, default, kind=(int, float)):
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ApiError(400, f"'{name}' must be a number.", param=name)
        return value

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise ApiError(400, "'max_tokens' must be a whole number.", param="max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings.", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "'seed' must be a whole number.", param="seed")
    if body.get("n", 1) != 1:
        raise ApiError(400, "Only one answer per request is served ('n' must be 1).", param="n")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise ApiError(400, "'top_k' must be a whole number.", param="top_k")
    fields = {"temperature": float(number("temperature", 1.0)), "top_p": float(number("top_p", 1.0)),
              # vLLM's and llama.cpp's extensions, taken the same way
              "top_k": max(0, top_k or 0), "min_p": float(number("min_p", 0.0)),
              "repetition_penalty": float(number("repetition_penalty", 1.0)),
              "presence_penalty": float(number("presence_penalty", 0.0)),
              "frequency_penalty": float(number("frequency_penalty", 0.0)), "stop": stop, "seed": seed}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    try:
        return engine_params(fields)
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None


class Service:
    """The engine and what the routes share: the models served (chat and Whisper), whether they are loaded,
    and the requests in flight (for the queue limit)."""

    def __init__(self, engine, models: list[str], api_key: str | None = None, whisper_models: list[str] = (),
                 max_waiting: int = DEFAULT_MAX_WAITING, max_audio_bytes: int = DEFAULT_MAX_AUDIO_MB << 20,
                 folder=None):
        from app.server_audio import AudioService
        from app.server_metrics import ServerMetrics

        self.engine, self.models, self.api_key = engine, models, api_key
        self.whisper_models, self.max_waiting = list(whisper_models), max_waiting
        self.audio = AudioService(engine, self.whisper_models, max_audio_bytes, folder) if whisper_models else None
        self.metrics = ServerMetrics(engine)
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.created = int(time.time())
        self.in_flight: dict[int, object] = {}  # handle id -> handle, for every request not yet answered
        self.contexts: dict[str, int] = {}  # chat model -> positions per slot (prompt and answer), once loaded
        self.recent_seconds = 2.0  # a running mean of how long a request takes, for Retry-After

    def warm(self) -> None:
        """Load every served model (a one-token answer, a second of noise) on a thread of its own; /health says
        503 until then."""
        import numpy as np

        from engine.api import ChatRequest, TranscribeRequest
        from engine.sampling import SamplingParams

        noise = np.random.default_rng(0).normal(0, 0.05, 16000).astype(np.float32)

        def run():
            try:
                for model in self.models:
                    self.engine.submit(ChatRequest("Hi", model=model, params=SamplingParams(max_tokens=1))).result()
                for model in self.whisper_models:
                    self.engine.submit(TranscribeRequest(noise, model=model, windowing="fixed", name="warm-up")).result()
                lanes = self.engine.status()["lanes"]
                self.contexts = {model: lanes[model]["context"] for model in self.models if model in lanes}
            except CadenceError as exc:
                self.load_error = str(exc)
            self.ready.set()

        threading.Thread(target=run, name="cadence-serve-warm", daemon=True).start()

    def admit(self) -> None:
        """Turn a new request away (429) when ``max_waiting`` requests already wait for a slot: those in flight that
        hold no slot, less the free slots of their model's lane (they are about to take them)."""
        for ident, handle in list(self.in_flight.items()):
            if handle.ended:
                self.in_flight.pop(ident, None)
        if len(self.in_flight) < self.max_waiting:  # fewer than the limit even if none had a slot
            return
        lanes = self.engine.status()["lanes"]
        decoding = {slot["request"] for lane in lanes.values() for slot in lane["slots"] if slot is not None}
        outside: dict[str, int] = {}
        for ident, handle in list(self.in_flight.items()):
            if ident not in decoding:
                model = getattr(handle.request, "model", "")
                outside[model] = outside.get(model, 0) + 1
        waiting = sum(max(0, n - sum(slot is None for slot in lanes.get(model, {}).get("slots", [])))
                      for model, n in outside.items())
        if waiting >= self.max_waiting:
            raise ApiError(429, f"The server is busy: {waiting} requests already wait for a slot. Try again shortly.",
                           kind="rate_limit_error", code="queue_full",
                           retry_after=max(1, round(self.recent_seconds)))

    def track(self, handle) -> None:
        """Count a submitted request until it ends (ended ones are dropped as requests come in)."""
        self.in_flight[handle.id] = handle

    def took(self, seconds: float) -> None:
        """A request was answered in ``seconds``: the running mean behind Retry-After."""
        self.recent_seconds = 0.8 * self.recent_seconds + 0.2 * seconds

    async def until_done(self, request: Request, handle, wait, timed: bool = True):
        """``wait()``'s value (run on a thread); None, with the handle cancelled, if the client goes away first.
        ``timed``: the wait was the whole request (it feeds Retry-After's estimate)."""
        self.track(handle)
        started = time.monotonic()
        task = asyncio.ensure_future(asyncio.to_thread(wait))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    if timed:
                        self.took(time.monotonic() - started)
                    return task.result()
                if await request.is_disconnected():
                    handle.cancel()
                    return None
        finally:
            if not handle.ended and not task.done():
                handle.cancel()

    def check_key(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(401, "The API key is missing or wrong (send 'Authorization: Bearer KEY').",
                           kind="authentication_error", code="invalid_api_key")


class Shape:
    """How one kind of completion spells its answer: whole, and as streamed chunks."""

    def __init__(self, prefix: str, whole: str, chunk: str, field: str, opening: dict | None):
        self.prefix, self.whole, self.chunk, self.field, self.opening = prefix, whole, chunk, field, opening

    def new_id(self) -> str:
        return f"{self.prefix}-{uuid.uuid4().hex[:24]}"

    def choice(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}} if self.field == "message" else {"text": text}

    def delta(self, text: str | None) -> dict:
        if self.field == "message":
            return {"delta": {} if text is None else {"content": text}}
        return {"text": text or ""}


CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", "message", {"role": "assistant", "content": ""})
TEXT = Shape("cmpl", "text_completion", "text_completion", "text", None)


def text_request(body: dict, service: "Service"):
    """The engine's request for a plain-text completion: the prompt's tokens as they are (no chat template)."""
    from engine.api import ChatRequest

    model = check_model(body.get("model"), service.models)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be one non-empty text.", param="prompt")
    for name in ("echo", "suffix", "logprobs", "best_of"):
        if body.get(name) not in (None, False, 1 if name == "best_of" else None):
            raise ApiError(400, f"'{name}' is not served here.", param=name)
    ids = service.engine.reference(model).tokenizer.encode(prompt)
    return ChatRequest(model=model, prompt_ids=ids, params=sampling_params(body))


def usage(answer) -> dict:
    prompt = int(answer.stats.get("prompt_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": len(answer.tokens),
            "total_tokens": prompt + len(answer.tokens)}


def finish_reason(answer) -> str:
    return "length" if answer.finish_reason == "length" else "stop"


def create_app(service: Service):
    app = FastAPI(title="Cadence", docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.retry_after is not None:
            headers = {"Retry-After": str(exc.retry_after)}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return error(exc)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):  # one sentence out, the traceback into the fault log
        from engine.errors import record_fault

        where = record_fault(exc)
        return error(ApiError(500, f"The server failed unexpectedly; the details are in {where}.", kind="server_error"))

    @app.get("/health")
    async def health():
        if not service.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if service.load_error:
            return JSONResponse({"status": "error", "message": service.load_error}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        service.check_key(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": m, "object": "model", "created": service.created,
                                            "owned_by": "cadence"} for m in service.models + service.whisper_models]}

    @app.get("/slots")
    async def slots(request: Request):
        """Every slot of every served model's lane, in llama.cpp's shape (plus the model and drafting)."""
        service.check_key(request.headers.get("authorization"))
        status = await asyncio.to_thread(service.engine.status)
        out = []
        for model, lane in status["lanes"].items():
            for i, slot in enumerate(lane["slots"]):
                busy = slot is not None
                out.append({"id": len(out), "model": model, "slot": i, "is_processing": busy,
                            "id_task": slot["request"] if busy else None, "n_ctx": lane["context"],
                            "next_token": {"n_decoded": slot["tokens"] if busy else 0},
                            "drafting": {"drafted": slot["drafted"], "accepted": slot["accepted"]} if busy else None})
        return out

    @app.get("/metrics")
    async def metrics(request: Request):
        service.check_key(request.headers.get("authorization"))
        text = await asyncio.to_thread(service.metrics.text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def read_body(request: Request) -> dict:
        service.check_key(request.headers.get("authorization"))
        await refuse_if_longer(request, MAX_BODY_BYTES, f"The request is larger than {MAX_BODY_BYTES >> 20} MB.")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"The request is larger than {MAX_BODY_BYTES >> 20} MB.")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return body

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        return await answer(request, body, chat_request(body, service.models), CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        return await answer(request, body, text_request(body, service), TEXT)

    async def answer(request: Request, body: dict, chat, shape: "Shape"):
        context = service.contexts.get(chat.model)
        if context is not None and chat.params.max_tokens >= context:
            raise ApiError(400, f"'max_tokens' ({chat.params.max_tokens}) must leave room for the prompt in this "
                                f"model's {context} positions per request.", param="max_tokens")
        service.admit()
        handle = service.engine.submit(chat)
        if body.get("stream"):  # refused before it starts (too long, ...): an HTTP error, as vLLM's
            first = await service.until_done(request, handle, handle.events.get, timed=False)
            if first is None:
                return Response(status_code=499)
            if first.kind == "failed":
                raise ApiError(400, first.message)
            options = body.get("stream_options") or {}
            return StreamingResponse(stream(handle, first, chat.model, shape, bool(options.get("include_usage"))),
                                     media_type="text/event-stream")
        try:
            result = await service.until_done(request, handle, handle.result)
        except CadenceError as exc:
            raise ApiError(400, str(exc)) from None
        if result is None:  # the client went away; its request was cancelled
            return Response(status_code=499)
        reason = finish_reason(result)
        service.metrics.finished(chat.model, result, reason)
        return {"id": shape.new_id(), "object": shape.whole, "created": int(time.time()), "model": chat.model,
                "choices": [{"index": 0, **shape.choice(result.text), "finish_reason": reason, "logprobs": None}],
                "usage": usage(result)}

    async def stream(handle, first, model: str, shape: "Shape", include_usage: bool):
        """The answer as chunk events; the handle is cancelled if the client goes away."""
        ident, created = shape.new_id(), int(time.time())

        def event(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": ident, "object": shape.chunk, "created": created, "model": model,
                                          "choices": choices, **extra}, ensure_ascii=False) + "\n\n"

        def chunk(text: str | None, reason: str | None = None) -> str:
            return event([{"index": 0, **shape.delta(text), "finish_reason": reason, "logprobs": None}])

        try:
            if shape.opening is not None:
                yield event([{"index": 0, "delta": shape.opening, "finish_reason": None, "logprobs": None}])
            update = first
            while True:
                if update is None:
                    update = await asyncio.to_thread(handle.events.get)
                if update.kind == "delta" and update.text:
                    yield chunk(update.text)
                elif update.kind == "finished":
                    result, reason = update.answer, finish_reason(update.answer)
                    service.metrics.finished(model, result, reason)
                    service.took(float(result.stats.get("end_to_end") or 0.0))
                    yield chunk(None, reason)
                    if include_usage:
                        yield event([], usage=usage(result))
                    break
                elif update.kind == "failed":
                    yield "data: " + json.dumps(ApiError(400, update.message).body()) + "\n\n"
                    break
                update = None
            yield "data: [DONE]\n\n"
        finally:
            if not handle.ended:
                handle.cancel()

    if service.audio is not None:
        from app.server_audio import add_audio_routes

        add_audio_routes(app, service)
    return app


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_host(host: str, api_key: str | None) -> None:
    if host not in LOOPBACK and not api_key:
        raise CadenceError(f"Serving on {host} would let other computers use this one's engine: give an API key "
                           "(--api-key or CADENCE_API_KEY), or serve on 127.0.0.1.")
