"""What the benchmark scripts share: a PostgreSQL database of their own, made and dropped."""

from __future__ import annotations

import re
import sys
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql


def admin_url(database_url: str) -> tuple[str, str]:
    """The same server with the ``postgres`` maintenance database, and the bench database name."""
    parts = urlsplit(database_url)
    name = parts.path.lstrip("/")
    if not name or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        sys.exit(f"--database-url must name a plain database (got {name!r})")
    if name in {"postgres", "template0", "template1"}:
        sys.exit(f"refusing to create/drop the {name!r} database")
    return urlunsplit(parts._replace(path="/postgres")), name


def database_recreate(database_url: str, *, drop_only: bool = False) -> None:
    maintenance, name = admin_url(database_url)
    with psycopg.connect(maintenance, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        if not drop_only:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
