"""Who may drive the server, before any route runs: the checks that keep a web page in a
browser on the same machine from using a server that has no API key.

A browser lets any page send a "simple" cross-origin request (GET, or a POST whose body is
``text/plain``, form-encoded or multipart) without asking the server first, and DNS
rebinding lets a page on a name it controls reach ``127.0.0.1`` as if it were its own
origin and read the answers. So:

- **POST bodies of the browser-only kinds are refused** (415): ``text/plain`` and
  ``multipart/form-data``. Form-encoded bodies stay accepted, because ``curl -d`` sends that
  Content-Type (the body is read as JSON whatever it says); browsers send an ``Origin`` with
  such a cross-site POST, which the next rule refuses.
- **Without** ``--api_key``: a request whose ``Host`` header names a host the server does not
  answer to gets 403 (DNS rebinding), and so does one whose ``Origin`` (sent by browsers,
  never by curl or SDKs) names another host than its ``Host`` and is not an allowed host
  (a cross-site page). Allowed hosts: ``--allowed_hosts``, else the loopback names when the
  server listens on a loopback address, else any (a server bound to every interface without
  a key is open by choice; set one of the two flags). ``/health`` is exempt: it says nothing.
- With ``--api_key`` the key decides: a page cannot attach it cross-site without a CORS
  preflight, which this server never grants.
- State changes are POST routes only (``app.py``); a GET changes nothing.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from hicache_jax.server.errors import error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
BROWSER_ONLY_TYPES = ("text/plain", "multipart/form-data")
OPEN_PATHS = frozenset({"/health"})


def host_of(value: str) -> str:
    """The host name in a ``Host`` header or an origin's netloc: ``"127.0.0.1:30000"`` ->
    ``"127.0.0.1"``, ``"[::1]:80"`` -> ``"::1"``, lower case, no trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str, configured: str | None) -> frozenset[str] | None:
    """The host names a key-less server answers to (None: any)."""
    if configured:
        return frozenset(host_of(h) for h in configured.split(",") if h.strip())
    if is_loopback(host_of(bind)):
        return LOOPBACK_NAMES | {host_of(bind)}
    return None


def _origin_host(origin: str) -> str | None:
    """The host an ``Origin`` header names; None for ``null`` or anything unparsable."""
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return None
    return host_of(parts.netloc) if parts.scheme and parts.netloc else None


class RequestGuard:
    """Pure ASGI middleware (as ``ApiKeyAuth``: it must not hide client disconnects)."""

    def __init__(self, app, hosts: frozenset[str] | None, check_hosts: bool):
        self.app = app
        self.hosts = hosts
        self.check_hosts = check_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                return await error_response(*refusal)(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, scope) -> tuple[int, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind in BROWSER_ONLY_TYPES:
                return 415, f"Content-Type {kind} is not accepted: send the JSON body as application/json"
        if not self.check_hosts or scope["path"] in OPEN_PATHS:
            return None
        host = host_of(headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            return 403, (
                f"Host {host!r} is not a name this server answers to ({', '.join(sorted(self.hosts))}); "
                "start it with --allowed_hosts or --api_key to serve others"
            )
        origin = headers.get("origin")
        if origin is not None:
            source = _origin_host(origin)
            if source is None or (source != host and (self.hosts is None or source not in self.hosts)):
                return 403, (
                    f"requests from the web page at {origin[:100]!r} are refused: "
                    "a server without --api_key serves its own host only (--allowed_hosts)"
                )
        return None
