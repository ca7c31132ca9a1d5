"""OpenAI's error object, the exception the router's handlers raise to send one, and the log line of each."""

from __future__ import annotations

import logging

from pdserve.wire.params import ErrorCode

log = logging.getLogger("pdserve.router")

# The HTTP status of a request that failed after it was admitted, by the error code of its last event: the one place
# a node's or the router's error becomes a status.
HTTP_STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CAPACITY: 503,
    ErrorCode.NODE_FAILED: 503,
    ErrorCode.KV_TRANSFER_FAILED: 503,  # a fault of the moment: worth a retry
    ErrorCode.DRAINING: 503,
    ErrorCode.INTERNAL: 500,
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a 429


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: `param` the one request field at fault (or None), `code` a string or None, never the
    status (OpenAI's clients read it as a string)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def logged_error(where: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error object of a request that failed, logged first as one line: where (method and path), status, code,
    param and message."""
    detail = "".join(f" {k}={v}" for k, v in (("code", code), ("param", param)) if v)
    log.warning("%s -> %d%s: %s", where, status, detail, message)
    return error_body(status, message, param, code)


def api_error_body(where: str, e: ApiError) -> dict:
    return logged_error(where, e.status, e.message, e.param, e.code)
