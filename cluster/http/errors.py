"""OpenAI-shaped errors for pdserve's HTTP edge (no FastAPI here, no torch).

:class:`ApiError` is every refusal the edge answers; :func:`error_body` is its JSON shape;
``HTTP_STATUS`` is the one place a router error code becomes an HTTP status.
"""

from __future__ import annotations

from typing import Any

from cluster.protocol import ErrorCode, RouterError

RETRY_AFTER_S = 1  # NOTE: 429 (queue full) and 503 (no healthy worker) are worth retrying soon

# NOTE: the one place an error code becomes an HTTP status.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX: 400,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.SLO_UNATTAINABLE: 429,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.ABORTED: 499,  # nginx's "client closed request": nobody is left to read it
    ErrorCode.WORKER_FAILED: 500,
    ErrorCode.KV_TRANSFER_FAILED: 500,
    ErrorCode.INTERNAL: 500,
}


class ApiError(Exception):
    """A request answered with an OpenAI-shaped error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after_s = retry_after_s  # the Retry-After of a 429 / 503 (None: the server's default)
        self.code = code or {
            400: "invalid_request",
            401: "invalid_api_key",
            404: "model_not_found",
            413: "request_too_large",
        }.get(status, "error")

    @classmethod
    def from_router(cls, e: RouterError) -> ApiError:
        status = HTTP_STATUS[e.code]
        return cls(status, str(e) or type(e).__name__, code=e.code.value, retry_after_s=e.retry_after_s)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": _error_type(e.status), "param": e.param, "code": e.code}}


def as_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RouterError):
        return ApiError.from_router(e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
