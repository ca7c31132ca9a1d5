"""OpenAI's error object, and the exception the router's handlers raise to send one."""

from __future__ import annotations

from pdserve.wire.protocol import ErrorCode

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
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a 429


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
