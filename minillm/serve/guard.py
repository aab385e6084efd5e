"""What stands between the network and the routes of `minillm serve`: checks that cost no model time.

* `Guard`, an ASGI middleware in front of every route (the API, /health, /metrics, static pages): the
  Host header must name this server (a DNS-rebinding page's requests carry its own name), and a body
  larger than the limit is refused on its Content-Length before a byte of it is read, or as soon as
  the bytes received pass the limit when it has none.
* `require_api_key`, a route dependency: `Authorization: Bearer KEY` on the routes it guards (/v1,
  /api, /metrics).
* `require_json`: POST bodies must say `Content-Type: application/json`, so a page on another site
  cannot send one without the browser asking this server first (a CORS preflight it will refuse).

Refusals are OpenAI-style error bodies (`protocol.ApiError`).
"""
from __future__ import annotations

import hmac
import ipaddress

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse

from minillm.serve.protocol import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def host_names(bound_host: str, allowed: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host names this server answers to; None means any. Bound to every interface and told no
    names, it cannot know the names clients use, so it takes any (with an API key, that is safe)."""
    names = {name.strip().lower().strip("[]") for name in allowed if name.strip()}
    if "*" in names or (bound_host in WILDCARD_HOSTS and not names):
        return None
    if bound_host not in WILDCARD_HOSTS:
        names.add(bound_host.lower().strip("[]"))
    return frozenset(names | set(LOOPBACK_NAMES))


def _host_name(header: str) -> str:
    """"example.com:8000" -> "example.com", "[::1]:8000" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: the Host check and the body-size limit, before any route runs."""

    def __init__(self, app, hosts: frozenset[str] | None, max_body_bytes: int, on_refusal=None):
        self.app, self.hosts, self.max_body_bytes = app, hosts, max_body_bytes
        self.on_refusal = on_refusal or (lambda status: None)      # e.g. Metrics.count_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = self._refusal(headers)
        if refusal is not None:
            self.on_refusal(refusal.status)
            response = JSONResponse(refusal.body(), status_code=refusal.status, headers={"connection": "close"})
            return await response(scope, receive, send)
        await self.app(scope, self._bounded(receive), send)

    def _refusal(self, headers: Headers) -> ApiError | None:
        if self.hosts is not None and _host_name(headers.get("host", "")) not in self.hosts:
            return ApiError(400, f"this server does not answer to the Host {headers.get('host', '')!r}; "
                                 "start it with --allowed-hosts to add a name", code="invalid_host")
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return ApiError(400, f"Content-Length {length!r} is not a number")
            if int(length) > self.max_body_bytes:
                return self.too_large()
        return None

    def too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} "
                             "bytes (minillm serve --max-body-bytes)", code="request_too_large")

    def _bounded(self, receive):
        """`receive`, counting the body's bytes: past the limit it raises the 413 (chunked uploads)."""
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self.too_large()
            return message
        return bounded_receive


def require_api_key(api_key: str | None):
    """A route dependency: the request must carry `Authorization: Bearer <api_key>` (None: no check).
    FastAPI's HTTPBearer, its own errors off, only declares the key in the OpenAPI document."""
    if api_key is None:
        async def open_route() -> None:
            return None
        return open_route
    expected = api_key.encode()
    bearer = HTTPBearer(auto_error=False, scheme_name="api_key", description="minillm serve --api-key")

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise ApiError(401, "a valid API key is required: send the header Authorization: Bearer <key>",
                           code="invalid_api_key")
    return check


def require_json(request: Request) -> None:
    """POST bodies are JSON, said so in Content-Type (a text/plain POST needs no CORS preflight)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"the request body must be JSON, sent with Content-Type: application/json "
                            f"(got {media_type or 'none'!r})", code="unsupported_media_type")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A line to print when the server listens beyond this machine without an API key."""
    if api_key is not None:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host.lower() == "localhost"
    if loopback:
        return None
    return (f"listening on {host} without an API key: anyone who can reach this address can use the model; "
            "set --api-key (or MINILLM_API_KEY)")
