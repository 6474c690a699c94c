"""Small ASGI helpers: read a body with a cap and a deadline, answer JSON and JSON errors.

The daemon serves a plain ASGI application (no framework): its few routes do not need one, and
every import counts towards the time to READY.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from .errors import BadInput, BodyTooLarge, EdgedError, RequestTimeout

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Header = tuple[bytes, bytes]


class ClientGone(Exception):
    """The client went away: before its request was read, or while its answer streamed."""


REFUSED_STATUS = "edged.refused_status"
"""Scope key: the status the HTTP layer answered a request with, and closed, because its body
could not be read (a broken chunk). The app, whether it was reading that body (it then sees a
hang-up) or answering without it, counts the request with this status: what the client got."""


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(scope: Scope, receive: Receive, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body: BodyTooLarge past `max_bytes` (checked against Content-Length
    before reading), RequestTimeout if it does not arrive within `timeout_s`."""
    declared = header(scope, b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadInput("Content-Length is not a number") from None
        if size > max_bytes:
            raise BodyTooLarge(f"request body of {size} bytes is over the limit of {max_bytes}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                body += message.get("body", b"")
                if len(body) > max_bytes:
                    raise BodyTooLarge(f"request body is over the limit of {max_bytes} bytes")
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g} s") from None


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client hangs up (call only once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_json(send: Send, status: int, data: Any, headers: Iterable[Header] = ()) -> None:
    await send_body(send, status, json.dumps(data, ensure_ascii=False).encode("utf-8"), "application/json", headers)


async def send_body(send: Send, status: int, body: bytes, content_type: str, headers: Iterable[Header] = ()) -> None:
    """A whole answer of known length."""
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body})


def error_json(error: EdgedError) -> dict[str, Any]:
    """The contract's error shape."""
    return {"error": {"code": error.code, "message": str(error)}}


async def send_error(send: Send, error: EdgedError, retry_after_s: int,
                     headers: Iterable[Header] = ()) -> None:
    """The contract's error shape: {"error": {"code", "message"}}; 503s say when to retry."""
    extra = list(headers)
    if error.http_status == 503:
        extra.append((b"retry-after", str(retry_after_s).encode()))
    if error.closes_connection:  # uvicorn then closes the connection after the response
        extra.append((b"connection", b"close"))
    await send_json(send, error.http_status, error_json(error), extra)
