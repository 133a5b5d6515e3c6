"""The example database of a run: the failing examples of earlier runs, replayed first by the next (CONF-RUN-5).

Hypothesis keeps, for each failing run, the choices that draw its failing program, and replays them before
drawing new ones. The kit's own shrunk program stays the reported counterexample; the database keeps what
reproduces it. A database is a directory (Hypothesis's `DirectoryBasedExampleDatabase`, the default) that
workers on one machine share, or a Redis server (`hypothesis[redis]`) that several machines share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

DEFAULT_DATABASE = ".hypothesis/examples"
"""Where `kvconform run` and the pytest plugin keep examples unless told otherwise: Hypothesis's own default place."""

NO_DATABASE = "none"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
REDIS_KEY_PREFIX = b"kvconform:"


class DatabaseError(Exception):
    """A database location that cannot be used; the message is one line that says why (a usage error)."""


def open_database(location: str) -> ExampleDatabase | None:
    """Return the database at `location`: a directory, a Redis URL, or `none` for no database."""
    if location == NO_DATABASE:
        return None
    if location.startswith(REDIS_SCHEMES):
        return _redis(location)
    path = Path(location)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DatabaseError(f"cannot use the example database {location}: {error.strerror or error}") from None
    return DirectoryBasedExampleDatabase(path)


def _redis(url: str) -> ExampleDatabase:
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError:
        raise DatabaseError(f"the example database {url} needs Redis support: pip install 'kvconform[redis]'") from None
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError as error:
        raise DatabaseError(f"cannot reach the example database {url}: {error}") from None
    return RedisExampleDatabase(client, key_prefix=REDIS_KEY_PREFIX)


class RunExamples(ExampleDatabase):
    """The part of a database that holds the examples of one kind of run: one adapter under one scheduling mode.

    Hypothesis deletes a stored example that no longer fails; without this separation, the run of one adapter
    would delete the failures another adapter's run stored under the same state machine.
    """

    def __init__(self, database: ExampleDatabase, identity: Iterable[str]) -> None:
        super().__init__()
        self.database = database
        self.prefix = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:16].encode() + b":"

    def save(self, key: bytes, value: bytes) -> None:
        self.database.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.database.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.database.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.database.move(self.prefix + src, self.prefix + dest, value)
