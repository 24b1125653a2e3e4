"""What every HTTP request passes before a route sees it (``sglite serve``): the Host
header (DNS rebinding), the Origin header (cross-site pages), the API key (SGLang's
``--api-key`` through ``add_api_key_middleware``), the body's media type (SGLang's
``validate_json_request``) and its size. docs/serving.md, "Security", says why each.

One pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer
streams and hide a client's disconnect from the routes). It reads a request's whole body
before the route runs, refusing it at ``max_body_size`` bytes, and hands the route the
bytes it read; every later ``receive`` (a disconnect) goes to the client as before.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_SIZE = 32 << 20  # bytes: a /generate batch of 1024 long prompts fits
# routes a prober or scraper reaches without the key (SGLang: /health*, /metrics)
OPEN_PREFIXES = ("/health",)
JSON_ONLY = "Unsupported Media Type: Only 'application/json' is allowed"  # SGLang's words
LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class SecurityPolicy:
    api_key: str | None = None
    bind_host: str = "127.0.0.1"
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)  # extra names; "*": any Host
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    metrics_require_api_key: bool = False

    def host_allowed(self, host: str) -> bool:
        """A Host header an honest client of this server sends: an IP address (DNS
        rebinding needs a name the attacker's DNS answers), a loopback name, the name the
        server was bound to, or one of --allowed-hosts."""
        name = _hostname(host)
        if "*" in self.allowed_hosts or _is_ip(name) or _is_loopback_name(name):
            return True
        return name == self.bind_host.lower() or name in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        """A web page's origin that may call this server: one on this machine's loopback,
        or a host named in --allowed-hosts. Any other page is another site's."""
        if "*" in self.allowed_hosts:
            return True
        scheme, _, rest = origin.partition("://")
        if scheme not in ("http", "https") or not rest:
            return False  # "null" (a sandboxed frame, a file), or not an origin at all
        name = _hostname(rest)
        return _is_loopback_name(name) or _is_loopback_ip(name) or name in self.allowed_hosts

    def needs_key(self, path: str) -> bool:
        if self.api_key is None or path.startswith(OPEN_PREFIXES):
            return False
        return path != "/metrics" or self.metrics_require_api_key

    def key_matches(self, authorization: str) -> bool:
        assert self.api_key is not None
        return hmac.compare_digest(authorization.encode(), f"Bearer {self.api_key}".encode())


def _hostname(host: str) -> str:
    """The name of a Host header or origin without its port ("[::1]:80" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback_ip(name: str) -> bool:
    return _is_ip(name) and ipaddress.ip_address(name).is_loopback


def _is_loopback_name(name: str) -> bool:
    return name in LOOPBACK_NAMES or name.endswith(".localhost")


class HttpGuard:
    """The checks, in order: Host (400), Origin (403), API key (401, SGLang's body),
    media type of a POST body (400, SGLang's words), body size (413)."""

    def __init__(self, app: App, policy: SecurityPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await _send_json(send, *refusal)
        if not _has_body(scope):
            return await self.app(scope, receive, send)
        body = await _read_body(receive, self.policy.max_body_size)
        if body is None:
            return await _send_json(send, 413, _error(scope["path"], (
                f"the request body is larger than {self.policy.max_body_size} bytes (--max-body-size)"), 413))
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope: Scope) -> tuple[int, Any] | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path, policy = scope["path"], self.policy
        host = headers.get("host")
        if host is not None and not policy.host_allowed(host):
            return 400, _error(path, f"the Host header {host!r} names no address of this server (a DNS rebinding "
                                     f"guard): start it with --allowed-hosts {_hostname(host)} to accept it")
        origin = headers.get("origin")
        if origin is not None and not policy.origin_allowed(origin):
            return 403, _error(path, f"a request from the web page at {origin!r} is refused (another site's page "
                                     "may not drive this server): start it with --allowed-hosts NAME to allow one",
                               403)
        if policy.needs_key(path) and not policy.key_matches(headers.get("authorization", "")):
            return 401, {"error": "Unauthorized"}
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > policy.max_body_size):
            return 413, _error(path, f"the request body has {length} bytes; at most {policy.max_body_size} "
                                     "(--max-body-size)", 413)
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if _has_body(scope) and media != "application/json":
            return 400, _error(path, JSON_ONLY)
        return None


def _has_body(scope: Scope) -> bool:
    """A request that carries a body (a POST without one, e.g. /flush_cache, has none)."""
    for k, v in scope["headers"]:
        if k == b"content-length" and v.strip() not in (b"", b"0"):
            return True
        if k == b"transfer-encoding":
            return True
    return False


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body once, then waits on the client (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _error(path: str, message: str, code: int = 400) -> dict[str, Any]:
    """The error body of the route's family: OpenAI's on /v1/*, SGLang's native one else."""
    if path.startswith("/v1/"):
        from sglite.entrypoints.openai_api import error_body

        return error_body(message, code=code)
    return {"error": {"message": message}}


async def _send_json(send: Send, status: int, content: Any) -> None:
    body = json.dumps(content).encode()  # (ASCII: a header's odd bytes cannot break it)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def parse_size(text: str) -> int:
    """A byte count such as 1048576, 512K, 32M or 1G (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    if not number.isdigit() or int(number) * scale <= 0:
        raise ValueError(f"--max-body-size must be a positive size such as 32M, 512K or 1048576, got {text!r}")
    return int(number) * scale


def parse_json(raw: bytes) -> tuple[str, Any]:
    """("ok", the parsed body) or ("error", why not): what a JSON-parsing worker process
    returns (an exception would carry the whole body back with it)."""
    try:
        return "ok", json.loads(raw)
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
        return "error", f"the body is not JSON: {' '.join(str(e).split())[:200]}"
    except RecursionError:
        return "error", "the body is JSON nested too deeply"


BACKGROUND_NICE = 10  # work done for one oversized body yields the CPU to the scheduler and the event loop


def start_json_worker() -> None:
    """A JSON-parsing worker process's initializer: Ctrl-C is the server's to handle (it
    stops its workers), not a traceback in each; and its work, for bodies over a
    megabyte, runs below the scheduler's priority."""
    import os
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # (a process of its own: no lock shared with the event loop waits on it)
        os.nice(BACKGROUND_NICE)
    except OSError:
        pass
