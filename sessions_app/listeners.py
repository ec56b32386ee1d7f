"""Who wants to know when a turn's status changes.

sessions_app never imports executions (imports point one way); the run engine registers here at
app start and is told, after commit, about every status change of a turn that executes an attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import transaction

log = logging.getLogger(__name__)

_turn_status_listeners: list[Callable[[str, str, str], None]] = []


def on_turn_status(listener: Callable[[str, str, str], None]) -> None:
    """Register ``listener(turn_id, attempt_id, status)``; called after the change commits."""
    if listener not in _turn_status_listeners:
        _turn_status_listeners.append(listener)


_turn_env_providers: list[Callable] = []


def on_turn_env(provider: Callable) -> None:
    """Register ``provider(turn) -> dict``: extra environment for the agent process of a turn."""
    if provider not in _turn_env_providers:
        _turn_env_providers.append(provider)


def turn_env(turn) -> dict:
    env: dict = {}
    for provider in _turn_env_providers:
        env.update(provider(turn) or {})
    return env


def turn_status_changed(*, turn_id, attempt_id, status: str) -> None:
    if attempt_id is None or not _turn_status_listeners:
        return

    def notify():
        for listener in list(_turn_status_listeners):
            try:
                listener(str(turn_id), str(attempt_id), status)
            except Exception:  # a listener's failure never fails the turn's own change
                log.exception("turn listener %s failed", listener)

    transaction.on_commit(notify)


_turn_reopen_checks: list[Callable] = []


def on_turn_reopen(check: Callable) -> None:
    """Register ``check(turn) -> str | None``: why a turn settled offline may not run again (its
    work went on without it, e.g. the engine made a new attempt), or None."""
    if check not in _turn_reopen_checks:
        _turn_reopen_checks.append(check)


def turn_reopen_refusal(turn) -> str | None:
    for check in _turn_reopen_checks:
        refusal = check(turn)
        if refusal:
            return refusal
    return None
