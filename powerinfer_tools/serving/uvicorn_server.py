"""The HTTP/1.1 server under ``pitools serve``: uvicorn with its h11 protocol, bounded where uvicorn
leaves the server open to a client, and a shutdown that lets streams end as OpenAI's protocol says.

- **Read timeouts.** A request's line and headers must arrive within ``header_timeout`` seconds of the
  connection being ready for them, its body within ``body_timeout`` of its headers; a client past them
  gets a 408 (a connection that sent no byte of a request is closed, as an idle keep-alive one is).
  Uvicorn has no such timeouts: a client sending a header line every few seconds holds a connection for
  ever, and a few thousand of them hold the server.
- **Malformed requests** (``Content-Length: -1``, a bad chunk size) get a 400, and a request line and
  headers over ``MAX_HEADER_BYTES`` a 431, in OpenAI's JSON error shape rather than uvicorn's plain text.
- **Lingering close** after such a refusal: our side is shut for writing and what the client still sends
  is read and dropped for a moment. Closing a socket with unread data in it sends a reset, which makes
  the client's system discard the answer before the client reads it (a 200 KB header got a bare reset).
- **Shutdown** (SIGTERM, Ctrl-C) tells the app first (``Server.shut_down``): running streams end with an
  error event and ``[DONE]`` and waiting requests get a 503, before uvicorn waits for connections to close.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Optional

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from powerinfer_tools.serving.protocol import error_body

MAX_HEADER_BYTES = 16 * 1024  # h11's default bound on a request line and headers (431 above it)
LINGER_SECONDS = 2.0  # how long a refused client may go on sending before its connection is closed
GRACE_SECONDS = 5  # how long uvicorn waits for responses to end at shutdown before cancelling them


class _Connection(h11.Connection):
    """h11's server side, remembering the protocol error that ended the request: its status hint is
    400, or 431 when the request line and headers outgrew their bound."""

    refusal: Optional[h11.RemoteProtocolError] = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            raise


class BoundedH11Protocol(H11Protocol):
    """Uvicorn's h11 protocol with read timeouts, JSON refusals and a lingering close."""

    def __init__(self, *args, header_timeout: float, body_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, MAX_HEADER_BYTES)
        # What the client owes us, in the client's h11 state: a request's line and headers, or its body.
        self._timeouts = {h11.IDLE: (header_timeout, "line and headers"), h11.SEND_BODY: (body_timeout, "body")}
        self._awaited = None  # the client state whose read deadline is running
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._lingering = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._follow_client()

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # after a refusal, what the client sends is dropped
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_client()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._lingering:  # answered already; h11 has nothing more to say on this connection
            self.transport.close()
        else:
            super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """Uvicorn's answer to a request h11 cannot read, in JSON: a 431 for headers over the bound, else 400."""
        refusal = self.conn.refusal
        if refusal is not None and refusal.error_status_hint == 431:
            self._refuse(431, f"the request's line and headers are longer than {MAX_HEADER_BYTES // 1024} KiB",
                         "request_headers_too_large")
        else:
            self._refuse(400, f"the request is not valid HTTP/1.1 ({refusal or msg})")

    def _follow_client(self) -> None:
        """Start the read deadline of what the client now owes, when that has changed."""
        state = self.conn.their_state
        if self._lingering or state is self._awaited:
            return
        self._awaited = state
        self._cancel_deadline()
        if state in self._timeouts:
            self._deadline = self.loop.call_later(self._timeouts[state][0], self._too_slow, state)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self, state) -> None:
        self._deadline = None
        seconds, part = self._timeouts[state]
        if state is h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # not a byte of a request: nobody to answer
            return
        self._refuse(408, f"the request's {part} did not arrive within {seconds:g} s", "request_timeout")

    def _refuse(self, status: int, message: str, code: Optional[str] = None) -> None:
        """Answer ``status`` in OpenAI's error shape (unless a response has begun), then close lingering."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app hears its client has gone; anything it sends goes nowhere
            self.cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            response = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
            for event in (response, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self._linger()

    def _linger(self) -> None:
        self._lingering = True
        self._cancel_deadline()
        self.transport.resume_reading()  # read (and drop) even if flow control had paused reading
        if self.transport.can_write_eof():
            self.transport.write_eof()  # once what we wrote has gone; the client's close then ends it
        self.loop.call_later(LINGER_SECONDS, self.transport.close)


class _Server(uvicorn.Server):
    """Uvicorn's server, telling the app it is stopping before it waits for connections to close."""

    def __init__(self, config: uvicorn.Config, on_shutdown):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


def http_server(app: Starlette, log_level: str = "info") -> uvicorn.Server:
    """The server for ``app`` (``create_app``'s): run it with ``.run(sockets=[...])``."""
    server = app.state.server
    protocol = functools.partial(BoundedH11Protocol, header_timeout=server.settings.header_timeout,
                                 body_timeout=server.settings.body_timeout)
    # No WebSocket protocol: an upgrade request would leave this protocol, and its bounds, behind.
    config = uvicorn.Config(app, http=protocol, ws="none", lifespan="on", log_level=log_level,
                            timeout_graceful_shutdown=GRACE_SECONDS)
    return _Server(config, server.shut_down)
