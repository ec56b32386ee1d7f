"""The OpenAPI document declares the limits and enums the code enforces on query parameters (R5).

The values come from the enforcing code itself: each list route's FilterSet (a ChoiceFilter's
choices become the parameter's ``enum``, an IsoDateTimeFilter its ``format: date-time``), the
pagination limit (``api.MAX_LIMIT``), the events routes' limit and the troubleshooting formats.
tests/api/test_schema_declares_limits.py probes every query parameter of the document: one the
server refuses values of must declare what it accepts, and the declared bounds and values must be
exactly what the server accepts, so a route or filter added without its declaration fails there.
"""

from __future__ import annotations

import re

# The events routes page with their own limit (chorus_site/events_api.py _events_page).
EVENTS_MAX_LIMIT = 500


def _filtersets() -> dict[str, type]:
    from executions.filters import ArtifactFilter, AttemptFilter, IssueFilter, RunFilter
    from sessions_app.filters import ConnectionFilter, SessionFilter, TurnFilter

    return {"/connections": ConnectionFilter, "/sessions": SessionFilter, "/sessions/{session_id}/turns": TurnFilter,
            "/issues": IssueFilter, "/runs": RunFilter, "/attempts": AttemptFilter, "/artifacts": ArtifactFilter}


def _filter_declaration(filterset, name: str) -> dict:
    import django_filters

    flt = filterset.base_filters.get(name)
    if isinstance(flt, django_filters.ChoiceFilter):
        return {"enum": [str(value) for value, _label in flt.extra["choices"]]}
    if isinstance(flt, django_filters.IsoDateTimeFilter):
        return {"format": "date-time"}
    return {}


def _declaration(route: str, name: str, has_cursor: bool) -> dict:
    from sessions_app.troubleshooting import FORMATS

    from .api import MAX_LIMIT

    if name == "limit":
        if re.search(r"/events$", route):
            return {"minimum": 1, "maximum": EVENTS_MAX_LIMIT}
        if has_cursor:
            return {"minimum": 1, "maximum": MAX_LIMIT}
    if name == "format" and route.endswith("/troubleshooting"):
        return {"enum": list(FORMATS)}
    filterset = _filtersets().get(route)
    return _filter_declaration(filterset, name) if filterset else {}


def _apply(parameter: dict, declared: dict) -> None:
    schema = parameter["schema"]
    # An optional parameter is anyOf [its type, null]: the bounds belong to its type.
    target = next((s for s in schema.get("anyOf", []) if s.get("type") != "null"), schema)
    target.update(declared)


def declare_query_limits(schema: dict, prefix: str = "/api/v1") -> dict:
    for path, operations in schema.get("paths", {}).items():
        route = path[len(prefix):] if path.startswith(prefix) else path
        for operation in operations.values():
            parameters = [p for p in operation.get("parameters", []) if p.get("in") == "query"]
            has_cursor = any(p["name"] == "cursor" for p in parameters)
            for parameter in parameters:
                declared = _declaration(route, parameter["name"], has_cursor)
                if declared:
                    _apply(parameter, declared)
    return schema
