"""The load generator's HTTP: a small HTTP/1.1 client over asyncio streams with keep-alive pooling
(atom-engine depends on neither aiohttp nor httpx, and a load generator wants little between it and
the socket), and a decoder of server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPResponse:
    def __init__(self, client: HTTPClient, status: int, headers: dict[str, str], conn) -> None:
        self.client, self.status, self.headers = client, status, headers
        self._reader, self._writer = conn
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked, sized or until close); pools the connection after."""
        reader = self._reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise ConnectionError("connection closed mid-body")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    break
                yield await reader.readexactly(size)
                await reader.readexactly(2)  # the CRLF after each chunk
            while (await reader.readline()).strip():  # trailers, up to the blank line
                pass
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                piece = await reader.read(min(remaining, 1 << 16))
                if not piece:
                    raise ConnectionError("connection closed mid-body")
                remaining -= len(piece)
                yield piece
        else:
            self.headers["connection"] = "close"
            while piece := await reader.read(1 << 16):
                yield piece
        self._done = True
        self.close()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def close(self) -> None:
        """Return the connection to the pool if the body was read and it may be reused."""
        if self._writer is None:
            return
        if self._done and self.headers.get("connection", "").lower() != "close":
            self.client._idle.append((self._reader, self._writer))
        else:
            self._writer.close()
        self._writer = None


class HTTPClient:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base URL must look like http://host:port, got {base_url!r}")
        self.host, self.netloc = url.hostname, url.netloc
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.api_key = api_key
        self._idle: list = []

    async def request(self, method: str, path: str, body: dict | None = None) -> HTTPResponse:
        payload = json.dumps(body).encode() if body is not None else b""
        head = [
            f"{method} {self.prefix}{path} HTTP/1.1",
            f"Host: {self.netloc}",
            "User-Agent: atom-bench",
            "Accept-Encoding: identity",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
        ]
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        message = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
        while True:
            reused = bool(self._idle)
            if reused:
                reader, writer = self._idle.pop()
            else:
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.ssl, limit=1 << 20
                )
            try:
                writer.write(message)
                await writer.drain()
                status_line = await reader.readline()
                if not status_line:
                    raise ConnectionResetError("the server closed the connection")
                break
            except OSError:
                writer.close()
                if not reused:  # a pooled connection may have timed out: retry on a fresh one
                    raise
        headers = {}
        while (line := await reader.readline()).strip():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        version, status, *_ = status_line.decode("latin-1").split()
        if version == "HTTP/1.0":
            headers["connection"] = "close"
        return HTTPResponse(self, int(status), headers, (reader, writer))

    async def get_json(self, path: str) -> dict:
        response = await self.request("GET", path)
        body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {response.status}: {body[:500].decode()}")
        return json.loads(body)

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()


class SSEDecoder:
    """Server-sent events -> the data of each event, from body pieces split anywhere."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, piece: bytes) -> list[str]:
        *lines, self._buffer = (self._buffer + piece).split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[6:] if line.startswith("data: ") else line[5:])
        return events
