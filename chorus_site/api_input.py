"""What the API takes in is made storable before any route sees it, and what it answers on error is
always the §8 body (issue 8 item 7).

- ``StorableParser`` (the NinjaAPI's parser): every string of a JSON body and of the query string,
  keys included, has NUL and lone surrogates replaced by U+FFFD (``clean_text``, the same rule as
  the daemon's reports).  PostgreSQL refuses NUL in text and jsonb and a lone surrogate cannot be
  encoded at all: unreplaced, either was a 500 on whatever field it reached (README "Input").
- ``ApiErrorBodyMiddleware``: under ``/api/``, an error answered outside django-ninja's exception
  handlers (an unknown route, a method the route lacks, Django's own 400/403/500 pages) becomes the
  §8 JSON body, so an API client never gets an HTML page.
"""

from __future__ import annotations

import json

from django.http import JsonResponse
from ninja import Field
from ninja.parser import Parser

from .redaction import clean_text

API_PREFIX = "/api/"


def storable(value):
    """A JSON value with every string (and key) made storable: NUL and lone surrogates → U+FFFD."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [storable(item) for item in value]
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    return value


class StorableParser(Parser):
    def parse_body(self, request):
        return storable(json.loads(request.body))

    def parse_querydict(self, data, list_fields, request):
        return storable(super().parse_querydict(data, list_fields, request))


ERROR_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 413: "payload_too_large", 429: "throttled", 500: "internal_error"}
MESSAGES = {404: "no such route", 405: "method not allowed on this route", 500: "internal error"}
KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


def error_body(code: str, message: str, detail: dict | None = None) -> dict:
    return {"error": {"code": code, "message": message, "detail": detail or {}}}


def api_error_response(request, status: int, detail: dict | None = None) -> JsonResponse:
    code = ERROR_CODES.get(status, "error")
    message = MESSAGES.get(status, code.replace("_", " "))
    detail = dict(detail or {})
    if status == 405:
        detail.setdefault("method", request.method)
    return JsonResponse(error_body(code, message, detail), status=status)


def is_api(request) -> bool:
    return request.path.startswith(API_PREFIX)


class ApiErrorBodyMiddleware:
    """Non-JSON error answers under /api/ are replaced by the §8 body (headers like Allow kept)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (response.status_code < 400 or not is_api(request) or response.streaming
                or response.get("Content-Type", "").startswith("application/json")):
            return response
        allowed = [m.strip() for m in response.get("Allow", "").split(",") if m.strip()]
        replacement = api_error_response(request, response.status_code, {"allowed": allowed} if allowed else None)
        for header in KEPT_HEADERS:
            if header in response:
                replacement[header] = response[header]
        return replacement


# ---------------------------------------------------------------- declared limits of the schemas
# The OpenAPI declares the limits and enums the code enforces (R5): lengths of the columns a field
# is stored in (pydantic refuses longer values: 422), enums the services check (400 with the allowed
# values in the detail; declared here so clients and schemathesis know them), integer ranges of
# PositiveIntegerField columns.
PG_INT_MAX = 2_147_483_647
# No control characters (CR/LF would end up in a Content-Disposition header); U+FFFD is allowed.
NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"


def Text(max_length: int, default=..., **kwargs):  # noqa: N802 — used like a type in schemas
    return Field(default, max_length=max_length, **kwargs)


def Enum(values, default=..., **kwargs):  # noqa: N802
    return Field(default, json_schema_extra={"enum": list(values)}, **kwargs)


def Count(default=..., *, ge: int = 0, le: int = PG_INT_MAX):  # noqa: N802
    return Field(default, ge=ge, le=le)


# ---------------------------------------------------------------- declared answers of every operation
COMMON_ERRORS = {
    400: "Bad request: malformed JSON, a refused value (enums: the allowed values are in the detail)",
    401: "Authentication required (session cookie, API token, task token or connection key)",
    403: "The caller's role does not allow this action",
    404: "Not found (also every object a caller without an ops role asks for)",
    409: "Conflict: an invalid transition, a version or idempotency conflict",
    413: "Payload too large: a body over DATA_UPLOAD_MAX_MEMORY_SIZE, a prompt over CHORUS_PROMPT_MAX_BYTES",
    422: "Request did not validate against this schema (lengths, ranges, types)",
    429: "Throttled: too many requests or failed credentials (Retry-After header)",
}


def declare_common_errors(schema: dict) -> dict:
    """Every operation declares the §8 error answers any API route may give (R5), with the ErrorBody."""
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status, description in COMMON_ERRORS.items():
                if status not in responses and str(status) not in responses:
                    responses[status] = {"description": description, "content": body}
    return schema
