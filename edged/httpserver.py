"""The HTTP layer: uvicorn's httptools protocol serving the App on our socket.

uvicorn is used for its HTTP/1.1 protocol and flow control only; the server loop, signals and
shutdown are edged's own (uvicorn's Server polls every 0.1 s and re-raises the signal at exit,
which would make SIGTERM exit non-zero). Import cost, measured here: uvicorn ~90 ms against
~200 ms for aiohttp.web, which is why aiohttp, the suggested server, was not used.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import select
import socket
from http import HTTPStatus
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from .admin import peer_of
from .app import App
from .asgi import REFUSED_STATUS, error_json
from .daemon import Daemon
from .errors import BadInput, EdgedError, HeadersTooLarge
from .metrics import Metrics

log = logging.getLogger(__name__)

HEADERS_END = b"\r\n\r\n"
OPEN_CONNECTIONS_PER_LIMIT = 4
"""Open connections allowed per `max_connections`: room for monitoring and for clients that
come and go, far below any file-descriptor limit."""
ABORT_AFTER_STALL_S = 5.0
"""Past the output timeout, more time a client that reads nothing has before its connection is
dropped: the app cuts its stream first (counted as a write stall: its clock starts at its next
write, once the next window is decoded), then this frees the socket."""
HANGUP_POLL_S = 0.25
"""How often a client that shut its sending side is checked for having closed altogether."""


class EdgedProtocol(HttpToolsProtocol):
    """uvicorn's protocol plus what it lacks for untrusted clients:
    - a deadline for request headers: a client that connects and trickles (or never sends) its
      headers is closed after `header_timeout_s`, so it holds a connection for a bounded time;
    - a cap on the bytes of a request line and headers (httptools buffers them without limit):
      past `max_header_bytes`, a JSON 431 and the connection closed;
    - the contract's JSON error for a request the parser rejects, instead of plain text;
    - a cap on open connections (`max_open`), so that clients holding sockets cannot use up the
      daemon's file descriptors: past it the oldest connection with no request under way (idle,
      or still sending its headers) is closed to make room, else the new one is. Monitoring
      still gets in past a crowd of idle sockets. (The app answers 503 busy past the lower
      `max_connections`, which still costs a descriptor per client.)
    - a client that reads nothing for `abort_after_s` (the output timeout + a grace) is dropped: a
      plain close waits for it to read what is buffered, and held the connection for ever
      (whatever is left unsent pauses writing: see connection_made);
    - a client that shuts its sending side after whole requests (a half-close) gets their
      answers, then the connection is closed (see eof_received);
    - bytes that start no request (a blank line after an answer, the rest of a body the app
      answered without reading) are held to the header deadline too: uvicorn stops its
      keep-alive clock at any input, and such a connection was held open for good;
    - a request asking to upgrade the connection (h2c, WebSocket) is answered as plain HTTP/1.1
      and the connection then closed; with a body it is refused (see on_headers_complete);
    - any one-digit HTTP version is parsed, so that the app answers 505 to versions not 1.x
      (httptools refuses most of them as malformed).
    No client blocks another either way: each connection is served independently by the loop."""

    def __init__(self, *args: Any, header_timeout_s: float, write_timeout_s: float, max_header_bytes: int,
                 max_open: int, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_open = max_open
        self.metrics = metrics
        self.header_timeout_s = header_timeout_s
        self.abort_after_s = write_timeout_s + ABORT_AFTER_STALL_S
        """Writes paused this long (the client reads nothing) drop the connection."""
        self._write_timer: asyncio.TimerHandle | None = None
        self._hangup_timer: asyncio.TimerHandle | None = None
        self.max_header_bytes = max_header_bytes
        self._header_timer: asyncio.TimerHandle | None = None
        self._reading_headers = True
        self._header_bytes = 0
        """Bytes received while this request's headers are incomplete."""
        self._tail = b""
        """The last bytes of the previous read, where the headers' end may have begun."""
        self._parsed_header_bytes = 0
        """Bytes of this request's line and complete headers as the parser hands them over: they
        count also what a read brought after the end of an earlier (pipelined) request."""
        self._refusal: EdgedError | None = None
        self._refuse_after_answers: EdgedError | None = None
        """A refusal that waits for the answers to the whole requests received before it."""
        self._read_no_more = False
        """Set after an upgrade request: what follows it on the connection is not HTTP/1.1."""
        self._answered_first: list[Any] = []
        """The cycles of those requests."""
        self._earlier: list[Any] = []
        """Cycles (uvicorn's RequestResponseCycle) of pipelined requests whose responses were
        still running when a later request's headers came: uvicorn tells only the latest cycle
        of a hang-up."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened_at = self.loop.time()
        if len(self.server_state.connections) > self.max_open and not self._close_oldest_idle():
            log.debug("closing a new connection: %d are open, all busy", self.max_open)
            transport.abort()
            return
        sock = transport.get_extra_info("socket")
        self.peer = None if sock is None else peer_of(sock)  # as the kernel saw it at connect time
        # Writing pauses (and the clock of pause_writing starts) as soon as anything is left
        # unsent: past the kernel's socket buffer, a client that reads nothing leaves some.
        transport.set_write_buffer_limits(high=0)
        self.parser.set_dangerous_leniencies(lenient_version=True)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refuse_after_answers is not None or self._read_no_more:  # uvicorn resumes reading (after
            self.transport.pause_reading()  # each answer, and as the app waits for a hang-up): ignored
            return
        if self._reading_headers:
            # The headers must end within the bytes left to them; what follows their end in the
            # same read (a body, a pipelined request) is not theirs.
            room = self.max_header_bytes - self._header_bytes
            if len(data) > room and HEADERS_END not in self._tail + data[: room + len(HEADERS_END)]:
                self._refuse(self._headers_too_large())
                return
            self._header_bytes += len(data)
            self._tail = (self._tail + data[-(len(HEADERS_END) - 1):])[-(len(HEADERS_END) - 1):]
        super().data_received(data)
        if not self._running_cycles() and self.timeout_keep_alive_task is None and not self.transport.is_closing():
            self._arm_header_timer()  # input that began no request: uvicorn's keep-alive clock is off

    def send_400_response(self, msg: str) -> None:
        self._refuse(self._refusal or BadInput(f"malformed HTTP request: {msg}"))

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_header_bytes(self, n: int) -> None:
        self._parsed_header_bytes += n
        if self._parsed_header_bytes > self.max_header_bytes:
            # Raised in a parser callback: httptools stops, and uvicorn answers through
            # send_400_response, which sends this instead.
            self._refusal = self._headers_too_large()
            raise self._refusal

    def _headers_too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(f"request line and headers are over the limit of {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        self._parsed_header_bytes = 0
        super().on_message_begin()
        self.scope["edged.peer"] = self.peer  # type: ignore[typeddict-unknown-key]
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._header_timer = _cancelled(self._header_timer)
        self._reading_headers = False
        self._earlier = self._running_cycles()
        if self.parser.should_upgrade():
            # llhttp ends a request that asks for an upgrade at its headers, and uvicorn drops the
            # rest of the read: a body would be lost, or parsed as a request of its own.
            if self._declares_body():
                self._refusal = BadInput("edged does not upgrade connections: send a request with a body"
                                         " without 'Connection: upgrade' (curl: without --http2)")
                raise self._refusal
            self._read_no_more = True
            self._poll_for_hangup()
        super().on_headers_complete()
        if self._read_no_more:
            self.cycle.keep_alive = False

    def _declares_body(self) -> bool:
        headers = {name.lower(): value.strip() for name, value in self.headers}
        return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") != b"0"

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_headers, self._header_bytes, self._tail = True, 0, b""

    def _running_cycles(self) -> list[Any]:
        """Cycles whose response is still being sent: earlier pipelined ones, and the current one."""
        return [c for c in [*self._earlier, self.cycle] if c is not None and not c.response_complete]

    def _unsupported_upgrade_warning(self) -> None:
        """Silent: a request asking for a WebSocket is answered as plain HTTP, and uvicorn's two
        warnings for each would let any local client fill the journal."""

    def _refuse(self, error: EdgedError) -> None:
        """Answer outside the app, as the parser cannot go on, and close. Whole requests received
        before the bytes it cannot read are answered first; the refusal is the answer after theirs
        (not in the middle of one: it would be read as part of it)."""
        if self.transport.is_closing():
            return
        self._answered_first = self._whole_requests()
        if not self._answered_first:
            self._send_refusal(error)
            return
        self._refuse_after_answers = error
        self.transport.pause_reading()
        self._poll_for_hangup()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refuse_after_answers is not None and all(c.response_complete for c in self._answered_first):
            self._send_refusal(self._refuse_after_answers)

    def _send_refusal(self, error: EdgedError) -> None:
        if self.transport.is_closing():  # the last answer closed it (its request said so)
            return
        if any(cycle.response_started for cycle in self._running_cycles()):  # never inside an answer
            self.transport.close()
            return
        reading = self.cycle
        if reading is not None and not reading.response_complete and not self._answered_first:
            # The request whose body broke; its app runs (nothing was queued before it) and
            # counts it, with this status. One queued behind whole requests is dropped unrun.
            reading.scope[REFUSED_STATUS] = error.http_status
        else:
            self.metrics.count_request("other", error.http_status)  # no route: the request is unreadable
        body = json.dumps(error_json(error)).encode()
        status = HTTPStatus(error.http_status)
        self.transport.write(
            f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        self.transport.close()

    def _close_oldest_idle(self) -> bool:
        # Idle: no request under way and nothing left to send (a response is "complete" in
        # uvicorn once its last bytes are handed over, which may still wait in the write buffer).
        idle = [c for c in self.server_state.connections
                if isinstance(c, EdgedProtocol) and c is not self and not c.transport.is_closing()
                and (c.cycle is None or c.cycle.response_complete)
                and c.transport.get_write_buffer_size() == 0]
        if not idle:
            return False
        min(idle, key=lambda c: c.opened_at).transport.abort()
        return True

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client sends no more. From a client that only shut its sending side (`nc -N`,
        socat), that is no hang-up: its whole requests are still answered, then the connection is
        closed (True keeps it open for writing); a request it left incomplete (a body or headers
        cut short) is dropped. A client closed altogether, or one with no whole request left to
        answer, ends the connection at once (None)."""
        if self._peer_closed():
            return None
        if self._refuse_after_answers is not None:  # the refusal comes after them and closes
            return True
        whole = self._whole_requests()
        if not whole:
            return None
        whole[-1].keep_alive = False  # closed once the last whole request is answered
        self._poll_for_hangup()
        return True

    def _whole_requests(self) -> list[Any]:
        """Cycles of the requests received whole and not yet answered, when nothing more is to be
        read: a request left incomplete behind them (a body cut short) is dropped, never run."""
        incomplete = self.cycle if self.cycle is not None and self.cycle.more_body else None
        whole = [c for c in self._running_cycles() if c is not incomplete]
        if whole and incomplete is not None:  # queued behind the whole ones (one runs at a time)
            self.pipeline = type(self.pipeline)(item for item in self.pipeline if item[0] is not incomplete)
        return whole

    def _poll_for_hangup(self) -> None:
        """Reading has stopped (at the end of input, or at bytes that are not HTTP), so a client
        that then closes would be found out only by the next write: a request waiting for a
        synthesis slot would keep its place in the queue. Look every HANGUP_POLL_S instead."""
        if self._hangup_timer is None:
            self._hangup_timer = self.loop.call_later(HANGUP_POLL_S, self._watch_for_hangup)

    def _watch_for_hangup(self) -> None:
        self._hangup_timer = None
        if self.transport.is_closing():
            return
        if self._peer_closed():
            self.transport.abort()
        elif self._running_cycles():
            self._poll_for_hangup()

    def _peer_closed(self) -> bool:
        """Whether the client closed its socket, not only its sending side: on a Unix socket the
        kernel then reports a hang-up (POLLHUP) besides the end of input."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return True
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLHUP)
        return any(events & select.POLLHUP for _, events in poller.poll(0))

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.abort_after_s, self._not_reading)

    def resume_writing(self) -> None:
        self._write_timer = _cancelled(self._write_timer)
        super().resume_writing()

    def _not_reading(self) -> None:
        self._write_timer = None
        log.info("dropping a connection whose client read nothing in %g s", self.abort_after_s)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer = _cancelled(self._header_timer)
        self._write_timer = _cancelled(self._write_timer)
        self._hangup_timer = _cancelled(self._hangup_timer)
        for cycle in self._earlier:  # their syntheses stop too (uvicorn tells self.cycle only)
            cycle.disconnected = True
            cycle.message_event.set()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._running_cycles():
            # A pipelined request's headers wait behind a response still being sent (uvicorn
            # stops reading meanwhile): their time starts again once it is done.
            self._arm_header_timer()
        elif not self.transport.is_closing():
            log.info("closing a connection that sent no complete request headers in %g s", self.header_timeout_s)
            self.transport.close()


def _cancelled(timer: asyncio.TimerHandle | None) -> None:
    """Cancel `timer` if there is one; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()


class _IntendedCutOff(logging.Filter):
    """Requests the daemon ends on purpose, which uvicorn would log as errors: a stream whose
    client stopped reading (the app returns early, uvicorn closes the connection), and a request
    cancelled when the drain timeout ran out (HttpServer.drain logs that itself). And uvicorn's
    warning for each request its parser refuses (answered with the JSON 400 and counted in the
    metrics): any local client could flood the journal with it."""

    QUIET = frozenset({"ASGI callable returned without completing response.", "Invalid HTTP request received."})

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        return record.getMessage() not in self.QUIET


class HttpServer:
    def __init__(self, server: asyncio.Server, state: ServerState, metrics: Metrics) -> None:
        self.server = server
        self.state = state
        self.metrics = metrics

    async def drain(self, timeout_s: float, cut_short: asyncio.Event | None = None) -> None:
        """Stop accepting, close idle connections, give running requests `timeout_s` to finish
        (or until `cut_short` is set), then cancel what is left."""
        loop = asyncio.get_running_loop()
        self.server.close()
        for connection in list(self.state.connections):
            connection.shutdown()  # idle: closed now; busy: closed after its response
        deadline = loop.time() + timeout_s
        cut = asyncio.ensure_future((cut_short or asyncio.Event()).wait())
        try:
            while self.state.tasks and loop.time() < deadline and not cut.done():
                await asyncio.wait({*self.state.tasks, cut}, timeout=deadline - loop.time(),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
        if self.state.tasks and cut_short is not None and cut_short.is_set():
            log.warning("second stop signal: not waiting for running requests")
        if self.state.tasks:
            log.warning("cancelling %d request(s) still running after %g s", len(self.state.tasks), timeout_s)
            for task in self.state.tasks:
                task.cancel()
            await asyncio.wait(set(self.state.tasks), timeout=1.0)

    def close(self) -> None:
        self.server.close()
        for connection in list(self.state.connections):
            connection.transport.close()
        self.metrics.close()


async def start_http(daemon: Daemon, sock: socket.socket) -> HttpServer:
    settings = daemon.settings.server
    metrics = Metrics(daemon)
    state = ServerState()
    limit = settings.max_connections

    def over_limit() -> bool:
        # The app checks the connection limit, not uvicorn (limit_concurrency): uvicorn's 503 is
        # plain text and logs a warning per refusal; this one is the contract's JSON busy error.
        return len(state.connections) > limit or len(state.tasks) > limit

    config = Config(
        App(daemon, metrics, over_limit), http="httptools", ws="none", lifespan="off", interface="asgi3",
        log_config=None, access_log=False, proxy_headers=False, server_header=False, date_header=False,
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
    )
    config.load()
    logging.getLogger("uvicorn.error").addFilter(_IntendedCutOff())
    factory = functools.partial(EdgedProtocol, config=config, server_state=state, app_state={},
                                header_timeout_s=settings.header_timeout_s,
                                write_timeout_s=daemon.settings.pipeline.output.timeout_s,
                                max_header_bytes=daemon.settings.limits.max_header_bytes,
                                max_open=OPEN_CONNECTIONS_PER_LIMIT * limit, metrics=metrics)
    server = await asyncio.get_running_loop().create_server(factory, sock=sock)
    return HttpServer(server, state, metrics)
