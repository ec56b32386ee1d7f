"""API tokens (SPEC §3.3, §8): create, authenticate, expiry, revocation; only a hash is stored."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.apps import apps
from django.db import models
from django.utils import timezone

from chorus_site.models import ApiToken
from chorus_site.redaction import redact
from chorus_site.tokens import token_authenticate, token_create, token_revoke
from tests.factories import make_user


@pytest.fixture
def user(db):
    return make_user()


def tamper(raw: str) -> str:
    return raw[:-1] + ("A" if raw[-1] != "A" else "B")


@pytest.mark.django_db
def test_created_token_authenticates_its_user(user):
    token, raw = token_create(user=user, name="ci", expires_in_days=30)
    scheme, prefix, secret = raw.split("_", 2)
    assert (scheme, prefix) == ("cho", token.prefix)
    assert len(secret) >= 40
    assert token_authenticate(raw) == user
    assert token_authenticate(f"  {raw}\n") == user
    stored = ApiToken.objects.get(pk=token.pk)
    assert stored.name == "ci"
    assert stored.last_used_at is not None
    assert timedelta(days=29) < stored.expires_at - timezone.now() <= timedelta(days=30)


@pytest.mark.django_db
def test_token_without_expiry_keeps_working(user):
    token, raw = token_create(user=user)
    assert token.expires_at is None
    ApiToken.objects.filter(pk=token.pk).update(created_at=timezone.now() - timedelta(days=3650))
    assert token_authenticate(raw) == user


@pytest.mark.django_db
def test_only_a_hash_of_the_secret_is_stored(user):
    token, raw = token_create(user=user)
    secret = raw.split("_", 2)[2]
    row = ApiToken.objects.filter(pk=token.pk).values().get()
    assert row["secret_hash"] == hashlib.sha256(secret.encode()).hexdigest()
    # Neither the secret nor the whole token is in any text or JSON column of any table.
    for model in apps.get_models():
        fields = [f.attname for f in model._meta.concrete_fields
                  if isinstance(f, (models.CharField, models.TextField, models.JSONField))]
        for values in model.objects.values_list(*fields) if fields else []:
            for value in values:
                assert secret not in str(value), f"{model.__name__} holds the plain token secret"


@pytest.mark.django_db
def test_expired_token_is_refused(user):
    token, raw = token_create(user=user, expires_in_days=1)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert token_authenticate(raw) is None


@pytest.mark.django_db
def test_revoked_token_is_refused_and_others_keep_working(user):
    first, first_raw = token_create(user=user, name="first")
    second, second_raw = token_create(user=user, name="second")
    assert token_revoke(prefix=first.prefix) is True
    assert token_revoke(prefix=first.prefix) is False  # already revoked
    assert token_revoke(prefix="nonexistent") is False
    assert token_authenticate(first_raw) is None
    assert token_authenticate(second_raw) == user
    assert ApiToken.objects.get(pk=first.pk).revoked is True


@pytest.mark.django_db
def test_wrong_secret_is_refused(user):
    token, raw = token_create(user=user)
    assert token_authenticate(tamper(raw)) is None
    assert token_authenticate(raw + "x") is None
    assert token_authenticate(raw[:-5]) is None
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=None)
    token_authenticate(tamper(raw))
    assert ApiToken.objects.get(pk=token.pk).last_used_at is None  # a failed attempt is no use


@pytest.mark.django_db
def test_secret_of_one_token_does_not_open_another(user):
    other_user = make_user()
    mine, mine_raw = token_create(user=user)
    theirs, theirs_raw = token_create(user=other_user)
    swapped = f"cho_{mine.prefix}_{theirs_raw.split('_', 2)[2]}"
    assert token_authenticate(swapped) is None


@pytest.mark.django_db
@pytest.mark.parametrize("raw", [None, "", "   ", "cho", "cho_", "cho__", "cho_deadbeef", "cho_deadbeef_",
                                 "Bearer cho_deadbeef_abc", "xyz_deadbeef_abcdefghijklmnopqrstuvwxyz0123456789"])
def test_malformed_tokens_are_refused(user, raw):
    token_create(user=user)
    assert token_authenticate(raw) is None


@pytest.mark.django_db
def test_token_of_an_inactive_user_is_refused(user):
    _, raw = token_create(user=user)
    user.is_active = False
    user.save(update_fields=["is_active"])
    assert token_authenticate(raw) is None
    user.is_active = True
    user.save(update_fields=["is_active"])
    assert token_authenticate(raw) == user


@pytest.mark.django_db
def test_last_used_is_written_at_most_once_a_minute(user):
    token, raw = token_create(user=user)
    token_authenticate(raw)
    first = ApiToken.objects.get(pk=token.pk).last_used_at
    token_authenticate(raw)
    assert ApiToken.objects.get(pk=token.pk).last_used_at == first
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now() - timedelta(minutes=2))
    token_authenticate(raw)
    assert ApiToken.objects.get(pk=token.pk).last_used_at > first


@pytest.mark.django_db
def test_plain_tokens_are_redacted_wherever_they_appear(user):
    _, raw = token_create(user=user)
    assert raw.split("_", 2)[2] not in redact(f"curl -H 'Authorization: Bearer {raw}' http://portal/api/v1/runs")
    assert raw.split("_", 2)[2] not in redact(f"token was {raw}")
