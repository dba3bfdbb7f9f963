"""What `cadence serve`'s routes share: OpenAI's error shape, and refusing a body too large before it is kept."""

from __future__ import annotations

from fastapi import Request

DRAIN_BYTES = 64 << 20  # beyond a limit, at most this much more is read (and dropped) before answering 413


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


async def refuse_if_longer(request: Request, limit: int, sentence: str) -> None:
    """413 for a body whose Content-Length passes ``limit``, before any of it is kept. Its bytes are read and
    dropped first (up to 64 MB more), so the client, still sending, gets the answer rather than a reset
    connection."""
    length = request.headers.get("content-length", "")
    if not length.isdigit() or int(length) <= limit:
        return
    if int(length) <= limit + DRAIN_BYTES:
        async for _ in request.stream():
            pass
    raise ApiError(413, sentence)
