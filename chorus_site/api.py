"""The NinjaAPI object (SPEC §8): auth, the error body, pagination and routers of each app."""

from __future__ import annotations

import base64
import binascii
import math

from django.core.exceptions import RequestDataTooBig
from django.db import OperationalError
from django.db.models import QuerySet
from django.http import Http404
from ninja import NinjaAPI, Schema, Status
from ninja.errors import AuthenticationError, HttpError, Throttled, ValidationError
from ninja.security import APIKeyCookie, HttpBearer
from psycopg_pool import PoolTimeout
from django.conf import settings

from .api_input import StorableParser, declare_common_errors
from .api_schema import declare_query_limits
from .errors import ApplicationError
from .idempotency import idempotent_call
from .permissions import has_ops_role
from .throttling import CallerThrottle, bearer_of, client_ident, credential_failed, credential_gate
from .tokens import token_authenticate


class SessionCookieAuth(APIKeyCookie):
    """The admin's session cookie, with CSRF enforced on unsafe methods."""

    param_name = settings.SESSION_COOKIE_NAME

    def _get_key(self, request):
        # Without a session cookie this scheme does not apply: let the bearer scheme answer
        # instead of failing a CSRF check that only protects cookie-authenticated requests.
        if self.param_name not in request.COOKIES:
            return None
        return super()._get_key(request)

    def authenticate(self, request, key):
        user = request.user
        return user if user.is_authenticated and user.is_active else None


class TokenAuth(HttpBearer):
    def authenticate(self, request, token):
        credential_gate(client_ident(request), token)  # 429 after too many failures
        user = token_authenticate(token)
        if user is not None:
            request.user = user
        return user


class ChorusAPI(NinjaAPI):
    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        return declare_query_limits(declare_common_errors(schema))


api = ChorusAPI(
    title="Chorus Ops API",
    version="1",
    description="Operations console for coding agents. Errors: {\"error\": {\"code\", \"message\", \"detail\"}}.",
    urls_namespace="api",
    auth=[SessionCookieAuth(), TokenAuth()],
    throttle=[CallerThrottle()],  # per caller; the daemon routes are mounted without it
    parser=StorableParser(),  # NUL and lone surrogates -> U+FFFD in every body and query string
)


def error_response(request, code: str, message: str, status: int, detail: dict | None = None):
    return api.create_response(request, {"error": {"code": code, "message": message, "detail": detail or {}}},
                               status=status)


@api.exception_handler(ApplicationError)
def _application_error(request, exc: ApplicationError):
    response = error_response(request, exc.code, exc.message, exc.status, exc.detail)
    if exc.status == 429 and exc.detail.get("retry_after_s"):
        response["Retry-After"] = str(exc.detail["retry_after_s"])
    return response


@api.exception_handler(ValidationError)
def _validation_error(request, exc: ValidationError):
    return error_response(request, "validation_error", "request did not validate", 422, {"errors": exc.errors})


@api.exception_handler(AuthenticationError)
def _auth_error(request, exc):
    if request.headers.get("Authorization"):
        credential_failed(client_ident(request), bearer_of(request))  # a credential was presented; none held
    return error_response(request, "unauthorized", "authentication required (session cookie or Bearer token)", 401)


@api.exception_handler(Http404)
def _not_found(request, exc):
    return error_response(request, "not_found", "not found", 404)


@api.exception_handler(RequestDataTooBig)
def _body_too_big(request, exc):
    return error_response(request, "payload_too_large", "request body too large", 413,
                          {"limit_bytes": settings.DATA_UPLOAD_MAX_MEMORY_SIZE})


@api.exception_handler(OperationalError)
def _database_busy(request, exc: OperationalError):
    """Every pooled connection of this process stayed taken for DATABASE_POOL_TIMEOUT_S: the
    process is overloaded. 503 with Retry-After tells a client or load balancer to try again
    (another process, or later) instead of a 500; other database errors stay 500."""
    if not isinstance(exc.__cause__, PoolTimeout):
        raise exc
    response = error_response(request, "busy", "the portal is busy: retry shortly", 503, {"retry_after_s": 1})
    response["Retry-After"] = "1"
    return response


@api.exception_handler(HttpError)
def _http_error(request, exc: HttpError):
    code = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
            429: "throttled"}.get(exc.status_code, "error")
    detail = {"retry_after_s": math.ceil(exc.wait)} if isinstance(exc, Throttled) and exc.wait else None
    return error_response(request, code, str(exc), exc.status_code, detail)  # ninja adds Retry-After


class ErrorBody(Schema):
    class Inner(Schema):
        code: str
        message: str
        detail: dict

    error: Inner


def require_ops(request):
    """Users without an ops role learn nothing: the objects do not exist for them (404)."""
    if not has_ops_role(request.auth):
        raise ApplicationError("not_found", "not found")
    return request.auth


def require_perm(request, perm: str):
    user = require_ops(request)
    if not user.has_perm(perm):
        raise ApplicationError("forbidden", "your role does not allow this action", {"permission": perm})
    return user


def act(request, *, perm: str, route: str, body: dict, action, status: int = 200,
        secret_fields: tuple[str, ...] = ()):
    """Permission, idempotency (Idempotency-Key header) and the answer of one acting route.

    ``secret_fields``: parts of the answer shown once and never kept in the idempotency record.
    """
    user = require_perm(request, perm)
    key = request.headers.get("Idempotency-Key")
    code, answer, _ = idempotent_call(user=user, route=route, key=key, body=body,
                                      action=lambda: (status, action(user, key)), secret_fields=secret_fields)
    return Status(code, answer)


# ---------------------------------------------------------------- cursor pagination
MAX_LIMIT = 200


def _encode_cursor(value) -> str:
    return base64.urlsafe_b64encode(str(value).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        return base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise ApplicationError("bad_request", "malformed cursor") from None


def paginate(qs: QuerySet, *, limit: int, cursor: str | None, field: str = "id", descending: bool = True,
             serialize=None) -> dict:
    """Keyset pagination on a unique, indexed field; the cursor is opaque to clients."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ApplicationError("bad_request", f"limit must be between 1 and {MAX_LIMIT}")
    qs = qs.order_by(f"-{field}" if descending else field)
    if cursor:
        raw = _decode_cursor(cursor)
        lookup = f"{field}__lt" if descending else f"{field}__gt"
        try:
            qs = qs.filter(**{lookup: raw})
        except (ValueError, TypeError, Exception) as exc:  # malformed uuid/int inside the cursor
            if isinstance(exc, ApplicationError):
                raise
            raise ApplicationError("bad_request", "malformed cursor") from None
    try:
        rows = list(qs[: limit + 1])
    except (ValueError, TypeError):
        raise ApplicationError("bad_request", "malformed cursor") from None
    next_cursor = _encode_cursor(getattr(rows[limit - 1], field)) if len(rows) > limit else None
    rows = rows[:limit]
    return {"items": [serialize(r) for r in rows] if serialize else rows, "next_cursor": next_cursor}


def query_params(request, *names) -> dict:
    """The named query parameters that were given (empty ones count as absent)."""
    return {n: request.GET.get(n) for n in names if request.GET.get(n) not in (None, "")}


def filter_or_400(filterset_class, params, queryset):
    filterset = filterset_class(params, queryset=queryset)
    if not filterset.is_valid():
        raise ApplicationError("bad_request", "invalid filter", {"errors": filterset.errors.get_json_data()})
    return filterset.qs


def register_routers():
    from executions import agent_api  # noqa: F401  (adds the agents' routes to the executions router)
    from executions.api import router as executions_router
    from sessions_app import actions_api  # noqa: F401  (adds the acting routes to the sessions router)
    from sessions_app.api import router as sessions_router
    from sessions_app.daemon_api import router as daemon_router

    from .events_api import router as events_router

    api.add_router("/", sessions_router)
    api.add_router("/", executions_router)
    api.add_router("/", events_router)
    api.add_router("/", daemon_router, throttle=[])  # daemons: only their key check is throttled


register_routers()
