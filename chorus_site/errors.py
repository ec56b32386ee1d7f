"""The one error type for refused operations (SPEC §8 error body)."""

from __future__ import annotations

HTTP_STATUS = {
    "bad_request": 400,
    "cursor_invalid": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "invalid_transition": 409,
    "version_conflict": 409,
    "idempotency_mismatch": 409,
    "idempotency_in_progress": 409,
    "connection_offline": 409,
    "process_alive": 409,
    "cursor_ahead": 409,
    "changes_unacknowledged": 409,
    "conflict": 409,
    "cursor_expired": 410,
    "payload_too_large": 413,
    "validation_error": 422,
    "throttled": 429,
}


class ApplicationError(Exception):
    def __init__(self, code: str, message: str, detail: dict | None = None, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail or {}
        self.status = status or HTTP_STATUS.get(code, 400)

    def as_body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "detail": self.detail}}

    def __repr__(self) -> str:
        return f"ApplicationError({self.code!r}, {self.message!r})"
