"""Helpers shared by the table-driven state machine tests of both apps."""

from __future__ import annotations

import pytest

from chorus_site.errors import ApplicationError
from tests.factories import events_since, last_event_id


def pairs(values, table):
    allowed = [(a, b) for a in values for b in values if b in table.get(a, set())]
    forbidden = [(a, b) for a in values for b in values if b not in table.get(a, set())]
    return allowed, forbidden


def ids(pair_list):
    return [f"{a}->{b}" for a, b in pair_list]


def row(model, pk) -> dict:
    return model.objects.filter(pk=pk).values().get()


def assert_one_event(mark, *, stream, kind, field, source, target, pk):
    new = events_since(mark)
    assert [(e.stream, e.kind) for e in new] == [(stream, kind)]
    assert new[0].data["id"] == str(pk)
    assert new[0].data[field] == target
    assert new[0].data["from"] == source
    return new[0]


def assert_refused(call, *, model, pk, code="invalid_transition"):
    """Refused with ``code`` (409), and nothing changed: not the row, not the event log."""
    before = row(model, pk)
    mark = last_event_id()
    with pytest.raises(ApplicationError) as refused:
        call()
    assert refused.value.code == code
    assert refused.value.status == 409
    assert row(model, pk) == before
    assert events_since(mark) == []
    return refused.value
