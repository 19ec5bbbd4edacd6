"""Where the hook keeps what it must not lose: SQLite for state and the inbox, a JSONL file for the action log.

- ``engines``: each engine's breaker state (:class:`EngineState` as JSON).
- ``inbox``: every alert delivery the webhook accepted, with the time it
  arrived. A delivery is written before the webhook answers 200, and marked
  done in the same transaction that saves the state it produced, so after a
  ``kill -9`` nothing is lost and nothing is applied twice: an unfinished
  delivery is decided again, and a decided one is not.
- ``controllers``: each engine's controller state (:class:`Steering` as JSON),
  so that a restarted hook steers on from where it was.
- ``<state_path>.actions.jsonl``: one line per action and per attempt to apply
  it, appended and flushed; ``tail -f`` it at 3 a.m.

All of it fits a byte budget (``remediate.store_max_bytes``, :class:`Budget`): the action log moves to ``.1``
(one generation kept) at its share, the journal is cut back to its share at each checkpoint, and the database
forgets its oldest decided deliveries as it nears its share, and any after ``INBOX_KEEP_SECONDS``. What waits
to be decided is never forgotten: it is bounded by count instead, per engine and per namespace, so that one
tenant's flood fills its own share of the inbox and no other's. A delivery that does not fit is refused whole
(:class:`InboxFull`), and the webhook answers 503, which Alertmanager retries: nothing is dropped in silence.

The connection is used from one thread at a time (the hook's event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from batchlens.config import Remediate
from batchlens.control.steering import Steering
from batchlens.remediation.breaker import EngineState

INBOX_KEEP_SECONDS = 7 * 86400.0  # decided deliveries kept a week, for the 3 a.m. question "what came in?"
# Deliveries waiting per engine: the breaker acts on one firing per cooldown, so past this a flood (any token
# holder, a loop upstream, an engine that cannot be reached) would only fill the disk, at megabytes a second.
MAX_PENDING_PER_ENGINE = 256
# And per namespace (a tenant's engines; "" the config's own): one tenant's flood leaves the others their room.
MAX_PENDING_PER_NAMESPACE = 1024
ACTION_LOG_MAX_BYTES = 16 * 2**20
JOURNAL_MAX_BYTES = 4 * 2**20
# The database forgets its oldest decided deliveries once it holds this share of its budget, down to the second.
PRUNE_AT, PRUNE_TO = 0.9, 0.8

SCHEMA = """
CREATE TABLE IF NOT EXISTS engines (
    vllm_instance TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS inbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    received_at REAL NOT NULL,
    vllm_instance TEXT NOT NULL,
    alertname TEXT NOT NULL,
    status TEXT NOT NULL,
    starts_at REAL NOT NULL,
    fingerprint TEXT NOT NULL,
    done_at REAL,
    outcome TEXT
);
CREATE INDEX IF NOT EXISTS inbox_pending ON inbox (done_at, id);
CREATE TABLE IF NOT EXISTS controllers (
    vllm_instance TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Delivery:
    """One alert of one webhook notification, as the inbox holds it."""

    received_at: float
    vllm_instance: str
    alertname: str
    status: str  # firing | resolved
    starts_at: float
    fingerprint: str
    id: int | None = None


T = TypeVar("T")


@dataclass(frozen=True)
class Budget:
    """The store's byte budget, shared out: the action log's two generations, the journal, the database."""

    total: int

    @property
    def action_log(self) -> int:
        return min(ACTION_LOG_MAX_BYTES, self.total // 8)

    @property
    def journal(self) -> int:
        return min(JOURNAL_MAX_BYTES, self.total // 16)

    @property
    def database(self) -> int:
        return self.total - 2 * self.action_log - self.journal


class InboxFull(Exception):
    """A notification the inbox cannot take, whole: ``reason`` is ``inbox_full`` (its share of deliveries waiting)
    or ``store_full`` (the byte budget, with nothing decided left to forget). The webhook answers 503."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class StoreError(Exception):
    """The state file cannot be used: the message says which file and why, and leaves it as it was."""


class Store:
    def __init__(self, path: str | Path, max_bytes: int = Remediate.model_fields["store_max_bytes"].default):
        self.path = Path(path)
        self.budget = Budget(max_bytes)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # an accepted delivery survives a power cut
            self._page = self._db.execute("PRAGMA page_size").fetchone()[0]
            # The journal is checkpointed at a quarter of its share, and cut back to its share after each.
            self._db.execute(f"PRAGMA journal_size_limit={self.budget.journal}")
            self._db.execute(f"PRAGMA wal_autocheckpoint={max(16, self.budget.journal // 4 // self._page)}")
            self._db.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(
                f"cannot use {self.path} as the hook's state ({exc}): it is not a batchlens state database, or "
                "cannot be written; point --state (remediate.state_path) at another file, nothing was changed"
            ) from None
        self.action_log = self.path.with_name(self.path.name + ".actions.jsonl")
        # The running hook uses the store through one thread (``run``): each write waits for its fsync
        # (synchronous=FULL, the action log's), and the event loop that answers the webhook must not. One
        # thread keeps the writes in order and the transactions of the shared connection apart.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchlens-store")

    async def run(self, method: Callable[..., T], /, *args: object, **kwargs: object) -> T:
        """``method(*args, **kwargs)``, one of this store's, in the store's thread."""
        call = functools.partial(method, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    def close(self) -> None:
        self._thread.shutdown(wait=True)  # the writes already queued land first
        self._db.close()

    def states(self) -> dict[str, EngineState]:
        rows = self._db.execute("SELECT vllm_instance, state FROM engines").fetchall()
        return {name: EngineState.from_dict(json.loads(state)) for name, state in rows}

    def controls(self) -> dict[str, Steering]:
        rows = self._db.execute("SELECT vllm_instance, state FROM controllers").fetchall()
        return {name: Steering.from_dict(json.loads(state)) for name, state in rows}

    def save_control(self, instance: str, state: Steering, now: float) -> None:
        self._upsert("controllers", instance, state.to_dict(), now)

    def accept(self, deliveries: list[Delivery], namespace_of: Mapping[str, str] | None = None) -> None:
        """Write a notification's deliveries in one transaction, all or none, and forget old decided ones.

        ``namespace_of``: each engine's namespace, whose share of waiting deliveries it counts against. Raises
        :class:`InboxFull` when an engine or a namespace has its fill waiting, or the budget has no room left.
        """
        if not deliveries:
            return
        now = max(d.received_at for d in deliveries)
        space = namespace_of or {}
        with self._transaction():
            self._db.execute("DELETE FROM inbox WHERE done_at < ?", (now - INBOX_KEEP_SECONDS,))
            engines: Counter[str] = Counter(dict(self._db.execute(
                "SELECT vllm_instance, COUNT(*) FROM inbox WHERE done_at IS NULL GROUP BY vllm_instance"
            ).fetchall()))  # fmt: skip
            namespaces: Counter[str] = Counter()
            for name, n in engines.items():
                namespaces[space.get(name, "")] += n
            for d in deliveries:
                engines[d.vllm_instance] += 1
                namespaces[space.get(d.vllm_instance, "")] += 1
            for name, n in engines.items():
                if n > MAX_PENDING_PER_ENGINE:
                    raise InboxFull("inbox_full", f"{name} has {MAX_PENDING_PER_ENGINE} deliveries waiting already")
            for namespace, n in namespaces.items():
                if n > MAX_PENDING_PER_NAMESPACE:
                    raise InboxFull("inbox_full", f"the namespace {namespace or '(the configured engines)'} has its "
                                    f"share, {MAX_PENDING_PER_NAMESPACE} deliveries, waiting already")  # fmt: skip
            self._make_room()
            self._db.executemany(
                "INSERT INTO inbox (received_at, vllm_instance, alertname, status, starts_at, fingerprint) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (d.received_at, d.vllm_instance, d.alertname, d.status, d.starts_at, d.fingerprint)
                    for d in deliveries
                ],
            )

    def _database_bytes(self) -> int:
        """The database's pages in use (its file keeps the free ones, and fills them before it grows)."""
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * self._page

    def _make_room(self) -> None:
        """Near the database's share, forget the oldest decided deliveries; InboxFull when none is left to forget."""
        share = self.budget.database
        if self._database_bytes() <= PRUNE_AT * share:
            return
        for _ in range(32):  # each round frees what the row count says it should, and pages free unevenly
            used = self._database_bytes()
            if used <= PRUNE_TO * share:
                return
            rows = self._db.execute("SELECT COUNT(*) FROM inbox").fetchone()[0]
            n = max(64, math.ceil((used - PRUNE_TO * share) / max(1.0, used / max(rows, 1))))
            gone = self._db.execute(
                "DELETE FROM inbox WHERE id IN (SELECT id FROM inbox WHERE done_at IS NOT NULL ORDER BY id LIMIT ?)",
                (n,),
            ).rowcount
            if gone == 0:
                break
        if self._database_bytes() > PRUNE_AT * share:
            raise InboxFull("store_full", f"the state store is at its byte budget ({self.budget.total} bytes, "
                            "remediate.store_max_bytes) with nothing decided left to forget")  # fmt: skip

    def bytes_on_disk(self) -> int:
        """What the store takes on its volume now: the database, its journal and the action log's generations."""
        files = (self.path, self.path.with_name(self.path.name + "-wal"), self.path.with_name(self.path.name + "-shm"),
                 self.action_log, self.action_log.with_name(self.action_log.name + ".1"))  # fmt: skip
        total = 0
        for file in files:
            with contextlib.suppress(OSError):  # not there (yet): nothing on the disk
                total += file.stat().st_size
        return total

    def pending(self) -> list[Delivery]:
        rows = self._db.execute(
            "SELECT id, received_at, vllm_instance, alertname, status, starts_at, fingerprint "
            "FROM inbox WHERE done_at IS NULL ORDER BY id"
        ).fetchall()
        return [Delivery(r[1], r[2], r[3], r[4], r[5], r[6], id=r[0]) for r in rows]

    def save(
        self, instance: str, state: EngineState, now: float, done: Delivery | None = None, outcome: str = ""
    ) -> None:
        """Save an engine's state, and mark the delivery that produced it done, atomically."""
        with self._transaction():
            self._upsert("engines", instance, state.to_dict(), now)
            if done is not None:
                self._mark(done, now, outcome)

    def mark_done(self, delivery: Delivery, now: float, outcome: str) -> None:
        """Mark a delivery decided with no engine state to save: its engine is gone."""
        with self._transaction():
            self._mark(delivery, now, outcome)

    def _mark(self, delivery: Delivery, now: float, outcome: str) -> None:
        self._db.execute("UPDATE inbox SET done_at = ?, outcome = ? WHERE id = ?", (now, outcome, delivery.id))

    def _upsert(self, table: str, instance: str, state: dict, now: float) -> None:
        self._db.execute(
            f"INSERT INTO {table} (vllm_instance, state, updated_at) VALUES (?, ?, ?) "  # table: ours, never input
            "ON CONFLICT (vllm_instance) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
            (instance, json.dumps(state), now),
        )

    def log_action(self, entry: dict) -> None:
        if self.action_log.exists() and self.action_log.stat().st_size >= self.budget.action_log:
            self.action_log.replace(self.action_log.with_name(self.action_log.name + ".1"))
        with self.action_log.open("a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
