"""What one client's connection may hold of `minillm serve`, before and around any route.

uvicorn's h11 protocol with the limits it lacks (the Guard in guard.py sees requests; this sees bytes):

* a request's headers must be complete `header_timeout_s` after its first byte, or after the connection
  opened: a client that sends half a request and waits (slowloris) is answered 408 and closed;
* its body must be complete `body_timeout_s` after its headers, read by a route or not;
* beyond `max_connections` open connections, a new one is answered 503 and closed at once.

A client that hangs up mid-upload is one line in the log; the route reading its body stops quietly.
"""
from __future__ import annotations

import http
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minillm.serve.protocol import ApiError


class LimitedH11Protocol(H11Protocol):
    """One connection: uvicorn's h11 protocol, plus a timer on whichever part of a request is due."""

    def __init__(self, *args, header_timeout_s: float, body_timeout_s: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.max_connections = max_connections
        self._deadline = None            # the armed timer: (asyncio.TimerHandle, "headers" or "body")
        self._closed_here = False        # by a limit, not by the client

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._log("503: too many open connections")
            self._refuse(ApiError(503, f"this server has {self.max_connections} open connections, its "
                                       "limit (minillm serve --max-connections); try again shortly",
                                  type="server_error", code="too_many_connections"))
            return
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._deadline is None:
            self._arm("headers")         # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.SEND_BODY:
            if self._deadline is None or self._deadline[1] != "body":
                self._arm("body")
        elif self.conn.their_state is not h11.IDLE:
            self._disarm()               # the request is all here (or the connection is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.cycle is not None and self.conn.their_state is h11.SEND_BODY and not self._closed_here:
            self._log("hung up before its request body was complete", self.scope)
        super().connection_lost(exc)

    # -- the timers --
    def _arm(self, part: str) -> None:
        self._disarm()
        seconds = self.header_timeout_s if part == "headers" else self.body_timeout_s
        self._deadline = (self.loop.call_later(seconds, self._too_slow, part), part)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline[0].cancel()
            self._deadline = None

    def _too_slow(self, part: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if part == "headers" and not self.conn.trailing_data[0]:
            self._close()                # opened and never sent a byte: nobody to answer
            return
        option, seconds = (("--header-timeout", self.header_timeout_s) if part == "headers"
                           else ("--body-timeout", self.body_timeout_s))
        error = ApiError(408, f"the request's {part} did not arrive within {seconds:g} s (minillm serve {option})",
                         code="request_timeout")
        request = self.scope if part == "body" else None
        if part == "body":
            self.cycle.disconnected = True       # the route waiting for the body stops; its answer is dropped
            self.cycle.message_event.set()
            if self.cycle.response_started:      # it answered without reading the body: only close
                self._log(f"closed: {error.message}", request)
                self._close()
                return
        self._log(f"408: {error.message}", request)
        self._refuse(error)

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` and close, whatever h11 thinks of the request (it may not have one yet)."""
        body = json.dumps(error.body()).encode()
        head = (f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\ncontent-type: application/json"
                f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self._close()

    def _close(self) -> None:
        self._closed_here = True
        self.transport.close()

    def _log(self, what: str, request: dict | None = None) -> None:
        client = "%s:%d" % self.client if self.client else "a client"
        line = f'"{request["method"]} {request["path"]}" ' if request is not None else ""
        self.logger.info("%s - %s%s", client, line, what)
