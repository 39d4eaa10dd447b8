"""The one exception type that carries an HTTP-visible failure.

Every layer raises `ApiError` with the spec's status and error type; only `pantheon/http/` turns it into a
response (`{"error":{"message","type","code":null}}`, plus headers such as `Retry-After`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        error_type: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.headers = dict(headers or {})
        # Fields added inside the error object (e.g. kv_used/kv_cap on a streamed context_over_budget).
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "type": self.error_type, "code": None}
        error.update(self.extra)
        return {"error": error}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.error_type!r}, {self.message!r})"


def shutting_down() -> ApiError:
    """503 server_shutting_down: the server drains for shutdown (new work refused, queued work at the deadline)."""
    return ApiError(503, "server_shutting_down", "server is shutting down", headers={"Retry-After": "1"})


def invalid_request(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


class ModelLoadError(Exception):
    """A GGUF file that cannot be served: unsupported type or architecture, truncated or corrupt data."""
