"""What the API server processes of one vLLM server share: the door's caps, what each one counts, the last arrival.

``vllm serve`` runs one API server process per data-parallel rank by default (``--api-server-count``
defaults to the DP size: 8 on DeepSeek's DP8 recipe), all accepting on one socket. Each has its own
``scheduler_config``, where vLLM reads the queued caps, and counts only the requests it took itself. A cap
set through one of them would hold for its share of the traffic alone. So the plugin keeps one small table
per server in shared memory, which every sibling maps (docs/vllm-plugin.md, "Several API servers"):

- **the caps and the prefill rate**, written under a file lock by whichever process took the PUT, with a
  generation number; every process copies them into its own ``scheduler_config`` before each request it
  admits and on every tick, and records the generation it applied, so that a GET can say which sibling
  has not (a hung or plugin-less process);
- **each process's counts** (prompt tokens still in prefill, unfinished requests), published on every tick
  and read by the others, so that the token cap compares the *whole server's* queued prompt tokens with the
  one cap the controller computed, and the request cap counts every sibling's requests. The other
  processes' counts are at most one tick old: like vLLM's own shared request count, a cap is exact to
  within the requests that arrive in the same instant on different processes;
- **the last arrival** (CLOCK_MONOTONIC is one clock for every process of a host), so that the
  inter-arrival gaps are the server's, not each process's share of them;
- **the signed calls taken** (their nonces, until their time is past), so that a signed call taken by one
  API server is a replay to every other: a captured PUT sent again lands on any of them.

Why shared memory and not a call between the siblings: vLLM does the same for its request count
(``SharedAdmissionStats``), it costs a few loads per request on vLLM's serving path, and it has no
process that must be up for the others to work. The table is identified by the ``vllm serve`` process that
started the siblings (its PID and start time): a restarted server never reads a dead one's caps.

The table itself is pure (a buffer of int64 slots, testable with a bytearray); :func:`open_table` maps it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import hashlib
import mmap
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

SLOT = 8  # int64 values per slot: 64 bytes, one cache line, so one process's writes never touch another's line
MAGIC = 0x626C656E73  # "blens": a table this module wrote
# The header slot (0) and each process's slot (1 + index), by position.
_MAGIC, _GENERATION, _TOKENS, _REQS, _RATE, _LAST_ARRIVAL, _PREDICTED_TTFT, _SLOTS = range(8)
_PID, _QUEUED_TOKENS, _UNFINISHED, _APPLIED, _BEAT = range(5)
#: A sibling whose last tick is older than this is counted as gone: its counts no longer add to the totals.
STALE_NS = 5_000_000_000
LOCK_POLL_SECONDS = 0.005
#: Signed calls remembered at once, over every sibling (each a nonce and when it may be forgotten). Past that
#: a call is refused (503) rather than one forgotten early, as one API server refuses past its own bound.
NONCES = 4096


@dataclass(frozen=True)
class Caps:
    """The caps in force on every sibling; generation 0: none set through the plugin yet (each process keeps
    what it was started with)."""

    generation: int
    max_num_queued_tokens: int | None
    max_num_queued_reqs: int | None
    prefill_tokens_per_second: float | None
    max_predicted_ttft_seconds: float | None = None


def _millis(value: float | None) -> int:
    return 0 if value is None else max(1, round(value * 1000))  # 0 is "none"; a value is kept to a thousandth


def _stored(value: int | None) -> int:
    return 0 if value is None else value + 1  # 0 is "no cap", so a fresh (zeroed) table means no caps


def _read(value: int) -> int | None:
    return None if value == 0 else value - 1


class SiblingTable:
    """The shared table over ``buffer``, seen from API server ``index`` of ``count``.

    ``try_lock`` takes the siblings' one lock without waiting (True: taken) and ``unlock`` gives it back: it
    serialises the changes (a PUT on each of two siblings at once, which would otherwise reach the engine cores
    in two orders). Readers need none: the generation is odd while a write is in progress, and a reader that
    sees it change reads again.
    """

    def __init__(
        self, buffer: memoryview, index: int, count: int,
        try_lock: Callable[[], bool] = lambda: True, unlock: Callable[[], None] = lambda: None,
        where: str = "this process's memory",
        nonce_lock: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):  # fmt: skip
        if not 0 <= index < count:
            raise ValueError(f"API server index {index} is not in 0..{count - 1}")
        self.values = buffer.cast("q") if buffer.format != "q" else buffer
        if len(self.values) < size(count) // 8:
            raise ValueError(f"a table for {count} API servers needs {size(count)} bytes, got {len(self.values) * 8}")
        self.index = index
        self.count = count
        self._try_lock, self._unlock = try_lock, unlock
        self.where = where  # for the log: the shared file's path
        self._nonce_lock = nonce_lock  # held for the few microseconds of one check, never across an await
        self._nonces = SLOT * (1 + count)  # where the remembered nonces start: pairs of (key, until)
        self._own = SLOT * (1 + index)
        if self.values[_MAGIC] not in (0, MAGIC):
            raise ValueError("the shared table holds something else than batchlens' caps")
        self.values[_MAGIC] = MAGIC

    def caps(self) -> Caps:
        while True:
            generation = self.values[_GENERATION]
            tokens, reqs, rate = self.values[_TOKENS], self.values[_REQS], self.values[_RATE]
            predicted = self.values[_PREDICTED_TTFT]
            if generation % 2 == 0 and self.values[_GENERATION] == generation:
                return Caps(generation // 2, _read(tokens), _read(reqs), rate / 1000 if rate else None,
                            predicted / 1000 if predicted else None)  # fmt: skip

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """The siblings' lock, awaited without blocking vLLM's loop (a sibling may hold it across the engine
        cores' answers). One coroutine of a process at a time: the process's own asyncio lock comes first."""
        while not self._try_lock():
            await asyncio.sleep(LOCK_POLL_SECONDS)
        try:
            yield
        finally:
            self._unlock()

    def set_caps(self, changes: Mapping[str, int | float | None], current: Caps) -> Caps:
        """Write ``changes`` over the caps in force, holding :meth:`exclusive`; ``current`` is what holds where
        none was written yet (this process's own caps, from its command line). Returns the caps now in force."""
        before = self.caps()
        base = before if before.generation else current
        merged = {
            "max_num_queued_tokens": base.max_num_queued_tokens,
            "max_num_queued_reqs": base.max_num_queued_reqs,
            "prefill_tokens_per_second": base.prefill_tokens_per_second,
            "max_predicted_ttft_seconds": base.max_predicted_ttft_seconds,
            **changes,
        }
        self.values[_GENERATION] += 1  # odd: a reader waits
        self.values[_TOKENS] = _stored(merged["max_num_queued_tokens"])
        self.values[_REQS] = _stored(merged["max_num_queued_reqs"])
        self.values[_RATE] = _millis(merged["prefill_tokens_per_second"])
        self.values[_PREDICTED_TTFT] = _millis(merged["max_predicted_ttft_seconds"])
        self.values[_GENERATION] += 1
        return self.caps()

    def publish(self, queued_tokens: int, unfinished: int, applied: int, now_ns: int) -> None:
        """This process's tick: its own counts, the generation of the caps it applied, and that it is alive."""
        own = self._own
        self.values[own + _PID] = os.getpid()
        self.values[own + _QUEUED_TOKENS] = queued_tokens
        self.values[own + _UNFINISHED] = unfinished
        self.values[own + _APPLIED] = applied
        self.values[own + _BEAT] = now_ns

    def _alive(self, index: int, now_ns: int) -> bool:
        beat = self.values[SLOT * (1 + index) + _BEAT]
        return beat > 0 and now_ns - beat < STALE_NS

    def totals(self, own_tokens: int, own_unfinished: int, now_ns: int) -> tuple[int, int]:
        """The whole server's (queued prompt tokens, unfinished requests): this process's live counts and the
        others' last published ones (a sibling gone for STALE_NS no longer holds requests)."""
        tokens, unfinished = own_tokens, own_unfinished
        for index in range(self.count):
            if index != self.index and self._alive(index, now_ns):
                base = SLOT * (1 + index)
                tokens += self.values[base + _QUEUED_TOKENS]
                unfinished += self.values[base + _UNFINISHED]
        return tokens, unfinished

    def behind(self, generation: int, now_ns: int) -> list[int]:
        """The siblings, by index, that have not applied caps of ``generation``, or are not ticking at all."""
        return [
            index
            for index in range(self.count)
            if not self._alive(index, now_ns) or self.values[SLOT * (1 + index) + _APPLIED] < generation
        ]

    def remember(self, nonce: str, until: int, now: float) -> str | None:
        """Take a signed call's ``nonce`` until ``until`` (unix seconds): None, taken; "replay" where a sibling (or
        this process) took it already; "full" where NONCES calls are remembered at once."""
        key = int(hashlib.sha256(nonce.encode()).hexdigest()[:15], 16) | 1  # 0 marks a free entry
        with self._nonce_lock():
            free = None
            for entry in range(self._nonces, self._nonces + 2 * NONCES, 2):
                taken_until = self.values[entry + 1]
                if taken_until >= now:
                    if self.values[entry] == key:
                        return "replay"
                elif free is None:
                    free = entry  # never used, or its time is past
            if free is None:
                return "full"
            self.values[free], self.values[free + 1] = key, until
        return None

    def set_slots(self, slots: int) -> None:
        """The server's batch slots (the limit times its engine cores), as a batch read or set through any sibling
        last saw them: the per-request door's slot wait counts against them in every sibling, not only in the one
        the controller's calls reached."""
        self.values[_SLOTS] = max(0, slots)

    def slots(self) -> int | None:
        """The server's batch slots as last seen; None: no batch read or set yet."""
        return self.values[_SLOTS] or None

    def swap_last_arrival(self, now_ns: int) -> int | None:
        """Record an arrival at ``now_ns``; the one before it on any sibling (None: the first). Lock-free: two
        arrivals in the same microsecond on two processes may both measure from the same one before."""
        previous = self.values[_LAST_ARRIVAL]
        self.values[_LAST_ARRIVAL] = max(previous, now_ns)
        return previous or None


def size(count: int) -> int:
    """The table's bytes for ``count`` API servers: a header slot, one slot each, and the nonces taken."""
    return 8 * SLOT * (1 + count) + 16 * NONCES


def private_table(index: int = 0, count: int = 1) -> SiblingTable:
    """A table in this process's memory: one API server, no siblings to share with."""
    return SiblingTable(memoryview(bytearray(size(count))), index, count)


def _server_identity(pid: int) -> str:
    """The ``vllm serve`` process's PID and start time (``/proc``): a reused PID is another server."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        started = stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces
    except (OSError, IndexError):
        started = "0"
    return f"{pid}-{started}"


PREFIX = "batchlens-siblings-"


def table_path(parent_pid: int, directory: str | None = None) -> Path:
    shm = Path("/dev/shm")
    base = Path(directory) if directory else shm if shm.is_dir() else Path(tempfile.gettempdir())
    return base / f"{PREFIX}{_server_identity(parent_pid)}"


def remove_stale(directory: Path) -> list[str]:
    """Remove the tables of servers that are gone (their ``vllm serve`` process no longer runs, or its PID is
    another process's now): what API server 0's exit could not remove, killed before its atexit ran."""
    removed = []
    for path in directory.glob(f"{PREFIX}*"):
        pid, _, started = path.name.removeprefix(PREFIX).partition("-")
        if pid.isdigit() and started and _server_identity(int(pid)) != f"{pid}-{started}":
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    return removed


def open_table(index: int, count: int, parent_pid: int | None = None, directory: str | None = None) -> SiblingTable:
    """The table the siblings of this server share: created by the first of them, mapped by every one.

    One API server alone gets a private table. The file is zero-filled at creation (no caps, nothing counted)
    and removed by API server 0 when it exits; API server 0 also removes the tables that servers killed before
    they could remove theirs left behind.
    """
    if count <= 1:
        return private_table()
    path = table_path(os.getppid() if parent_pid is None else parent_pid, directory)
    if index == 0:
        remove_stale(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size(count):
            os.ftruncate(fd, size(count))  # the siblings agree on the size; zeroes, as mmap maps them
        mapped = mmap.mmap(fd, size(count))
    except BaseException:
        os.close(fd)
        raise

    def try_lock() -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    @contextlib.contextmanager
    def nonce_lock() -> Iterator[None]:
        # A record lock on the nonces alone: apart from flock's lock above (Linux keeps the two apart), which a
        # sibling may hold across the engine cores' answers.
        fcntl.lockf(fd, fcntl.LOCK_EX, 16 * NONCES, size(count) - 16 * NONCES)
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 16 * NONCES, size(count) - 16 * NONCES)

    if index == 0:
        atexit.register(_remove, path)
    unlock = lambda: fcntl.flock(fd, fcntl.LOCK_UN)  # noqa: E731 (one line, beside its twin)
    return SiblingTable(memoryview(mapped), index, count, try_lock, unlock, str(path), nonce_lock)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
