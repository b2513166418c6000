"""ASGI middleware of the server: a request-body size limit and a last-resort error handler.

Both are plain ASGI (no BaseHTTPMiddleware), so a streamed response passes through untouched.
"""

from __future__ import annotations

import json
import logging

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom_engine.server.anthropic_protocol import anthropic_error, is_messages_path

logger = logging.getLogger("atom_engine.server")


async def send_json_error(send: Send, status: int, message: str, type_: str, path: str) -> None:
    """An OpenAI-style error body, or Anthropic's on the /v1/messages routes."""
    if is_messages_path(path):
        error = anthropic_error(status, message)
    else:
        error = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    body = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """Refuse request bodies over `max_bytes` with a 413, before reading them when the client
    declares the length, as soon as the limit is passed when it streams the body (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _message(self) -> str:
        return (
            f"the request body exceeds the server's limit of {self.max_bytes} bytes "
            "(atom serve --max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # the HTTP server refuses a malformed length itself
                if declared > self.max_bytes:
                    await send_json_error(
                        send, 413, self._message(), "RequestTooLarge", scope["path"]
                    )
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises HTTPExceptions from body reading as they are.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)


class CatchAll:
    """Answer an unexpected exception with a 500 OpenAI-style body and keep the connection.

    Starlette's own last-resort handler re-raises after answering, which makes the HTTP server
    close the keep-alive connection: the client's next request on it would fail.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            logger.exception("request %s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise  # nothing can be answered any more; the connection has to go
            message = f"internal error: {type(e).__name__}: {e}"
            await send_json_error(send, 500, message, "InternalServerError", scope["path"])
