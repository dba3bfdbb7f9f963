"""`cadence serve`: the engine behind an OpenAI-compatible HTTP API on this machine (see app/server.py)."""

from __future__ import annotations

import os

from engine.errors import CadenceError

from app.cli.common import add_engine_flags, check_model, engine_options, err, parse_batch, quiet_libraries

DEFAULT_PORT = 8000


def add_parser(sub, backends) -> None:
    from engine.models import DEFAULT_CHAT, DEFAULT_WHISPER

    from app.server_limits import DEFAULT_MAX_AUDIO_MB, DEFAULT_MAX_WAITING

    p = sub.add_parser("serve", help="serve the engine over an OpenAI-compatible HTTP API (127.0.0.1 unless told)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this computer only; any other needs --api-key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: CADENCE_API_KEY)")
    p.add_argument("--model", action="append", default=None, metavar="NAME",
                   help=f"chat model to serve, loaded at start (repeatable; default {DEFAULT_CHAT})")
    p.add_argument("--whisper-model", action="append", default=None, metavar="NAME",
                   help=f"Whisper model for /v1/audio, loaded at start (repeatable; default {DEFAULT_WHISPER}; "
                        "'none' serves no audio routes)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help=f"requests that may wait for a slot; beyond them new ones get 429 (default {DEFAULT_MAX_WAITING})")
    p.add_argument("--max-audio-mb", type=int, default=DEFAULT_MAX_AUDIO_MB, metavar="MB",
                   help=f"largest audio upload taken (default {DEFAULT_MAX_AUDIO_MB})")
    add_engine_flags(p, backends, auto_width="measured for this machine, for the most tokens per second over all "
                                            "clients")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from engine.models import CHAT, DEFAULT_CHAT, DEFAULT_WHISPER, WHISPER

    from app.server import Service, check_host, create_app

    api_key = args.api_key or os.environ.get("CADENCE_API_KEY") or None
    check_host(args.host, api_key)
    if not 0 <= args.port <= 65535:
        raise CadenceError(f"--port must be between 0 and 65535 (got {args.port}).")
    models = [check_model(name, CHAT).name for name in (args.model or [DEFAULT_CHAT])]
    asked = args.whisper_model or [DEFAULT_WHISPER]
    whisper = [] if asked == ["none"] else [check_model(name, WHISPER).name for name in asked]
    if args.max_waiting < 1 or args.max_audio_mb < 1:
        raise CadenceError("--max-waiting and --max-audio-mb must be at least 1.")
    batch = parse_batch(args.batch)
    options = engine_options(args)
    quiet_libraries()
    import uvicorn

    from engine import Engine

    # Many clients share a server's lanes: its automatic width is chosen for throughput (engine.calibration).
    engine = Engine(backend=args.backend, batch=batch, width_rule="throughput", **options)
    service = Service(engine, models, api_key, whisper, max_waiting=args.max_waiting,
                      max_audio_bytes=args.max_audio_mb << 20)
    service.warm()
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    original_startup = server.startup

    async def startup(sockets=None):  # say where it listens once it does (port 0: the one picked)
        await original_startup(sockets)
        for listener in server.servers:
            for sock in listener.sockets:
                host, port = sock.getsockname()[:2]
                err(f"Serving {', '.join(models + whisper)} at http://{host}:{port}/v1 (models load now; GET /health says "
                    "when they are ready). Ctrl-C stops.")

    server.startup = startup
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
