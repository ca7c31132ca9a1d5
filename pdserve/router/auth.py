"""The API key guard: with a key configured, every route but /health needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.errors import logged_error

OPEN_PATHS = frozenset({"/health"})


class ApiKeyGuard:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which would get between a stream and its disconnect)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await refusal(f"{scope['method']} {scope['path']}")(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        return authorized(dict(scope["headers"]).get(b"authorization", b""), self.key)


def authorized(header: bytes, key: bytes) -> bool:
    """Whether an Authorization header's value carries `key`."""
    return hmac.compare_digest(bearer_token(header), key)  # constant time in the key's content


def refusal(where: str) -> JSONResponse:
    """The answer to a request without the key (logged as it is made)."""
    body = logged_error(where, 401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def bearer_token(header: bytes) -> bytes:
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""
