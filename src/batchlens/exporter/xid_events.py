"""Xid errors, from NVML's event API, counted per GPU without a tick ever waiting for one.

An Xid is the driver's report of a GPU fault (NVIDIA's "Xid Errors" catalogue): 79, the GPU fell off the bus;
48, a double-bit ECC error; 13 or 31, a kernel's fault, most often the application's. NVML delivers them
through an event set: ``nvmlDeviceRegisterEvents`` for each GPU, then ``nvmlEventSetWait``, which blocks until
an event comes or its timeout passes. So one thread of its own waits on the set, and the tick only reads what
it counted.

Between the two sits a count per (GPU, Xid label), not a queue of events: it is bounded by the GPUs and the
labels (the codes gpu_faults.py names, the rest as ``other``), whatever the rate of an Xid storm, and it loses
no event as a full queue would. Each Xid is logged once a minute per GPU and code, so a storm is a few lines.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from batchlens.gpu_faults import APPLICATION_XIDS, CRITICAL_XIDS, xid_label

log = logging.getLogger("batchlens.exporter")

SAID_EVERY = 60.0  # seconds between two log lines for one GPU's one Xid code
WAIT_MS = 500  # how long one nvmlEventSetWait blocks: the longest a close waits for the thread


def handle_key(handle: Any) -> Any:
    """A device handle's identity. pynvml gives a new ctypes pointer object per call (an event's ``device``
    among them), so two handles of one GPU are equal by the address they point to, not as objects."""
    try:
        return ctypes.addressof(handle.contents)
    except (AttributeError, ValueError):  # not a ctypes pointer (a binding that hands out objects), or NULL
        return handle


class XidWaiter:
    """The thread that waits on an NVML event set for the GPUs' Xids, and what it counted.

    ``gpus``: (index, handle) of each GPU to watch. :meth:`start` registers them in the calling thread (NVML's
    own order: register, then wait) and starts the thread; a GPU or driver without Xid events is left out and
    said once. :meth:`counts` is the tick's read: (GPU index, Xid label) -> events since the start; the index is
    -1 for an event whose device matched none of ours.
    """

    def __init__(self, nvml: ModuleType, gpus: Sequence[tuple[int, Any]], *, wait_ms: int = WAIT_MS):
        self._nvml, self._gpus, self._wait_ms = nvml, list(gpus), wait_ms
        self._index = {handle_key(handle): index for index, handle in self._gpus}
        self._counts: Counter[tuple[int, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._said: dict[tuple[int, int], float] = {}
        self._thread: threading.Thread | None = None
        self._set: Any = None
        #: GPU indexes whose Xids are watched.
        self.watched: list[int] = []
        #: Errors of the wait itself (reason -> count), other than its timeout.
        self.errors: Counter[str] = Counter()

    def start(self) -> bool:
        """Register and start waiting; False (said in the log) where this driver cannot deliver Xid events."""
        n = self._nvml
        try:
            self._set = n.nvmlEventSetCreate()
        except n.NVMLError as exc:
            log.warning("nvml: no event set (%s): Xid errors are not counted on this host", exc)
            return False
        for index, handle in self._gpus:
            try:
                if not n.nvmlDeviceGetSupportedEventTypes(handle) & n.nvmlEventTypeXidCriticalError:
                    raise n.NVMLError(n.NVML_ERROR_NOT_SUPPORTED)
                n.nvmlDeviceRegisterEvents(handle, n.nvmlEventTypeXidCriticalError, self._set)
            except n.NVMLError as exc:
                log.warning("nvml: GPU %d delivers no Xid events (%s): its Xids are not counted", index, exc)
                continue
            self.watched.append(index)
        if not self.watched:
            self._free()
            return False
        self._thread = threading.Thread(target=self._wait, name="nvml-xid-events", daemon=True)
        self._thread.start()
        return True

    def counts(self) -> dict[tuple[int, str], int]:
        with self._lock:
            return dict(self._counts)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (it leaves within one wait) and free the set; a wait stuck in the driver is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("nvml: the Xid waiter is stuck in the driver; leaving it")
                return
        self._free()

    def _free(self) -> None:
        if self._set is not None:
            try:
                self._nvml.nvmlEventSetFree(self._set)
            except self._nvml.NVMLError as exc:
                log.debug("nvml: freeing the event set: %s", exc)
            self._set = None

    def _wait(self) -> None:
        n = self._nvml
        while not self._stop.is_set():
            try:
                data = n.nvmlEventSetWait(self._set, self._wait_ms)
            except n.NVMLError_Timeout:
                continue
            except n.NVMLError as exc:
                # A lost GPU fails the wait (GpuIsLost): the tick marks it lost. Counted, and a pause, not a spin.
                reason = type(exc).__name__.removeprefix("NVMLError_")
                if not self.errors[reason]:
                    log.warning("nvml: waiting for Xid events failed: %s; waiting again", exc)
                self.errors[reason] += 1
                self._stop.wait(1.0)
                continue
            except Exception:  # a binding's own failure: logged, and the thread carries on
                log.exception("nvml: waiting for Xid events raised; waiting again in 1 s")
                self.errors["binding"] += 1
                self._stop.wait(1.0)
                continue
            if data.eventType & n.nvmlEventTypeXidCriticalError:
                self._count(self._index.get(handle_key(data.device), -1), int(data.eventData))

    def _count(self, index: int, xid: int) -> None:
        with self._lock:
            self._counts[(index, xid_label(xid))] += 1
        now = time.monotonic()
        if now - self._said.get((index, xid), -math.inf) >= SAID_EVERY:
            self._said[(index, xid)] = now
            meaning = CRITICAL_XIDS.get(xid) or APPLICATION_XIDS.get(xid) or "see NVIDIA's Xid catalogue"
            level = logging.ERROR if xid in CRITICAL_XIDS else logging.WARNING
            where = f"GPU {index}" if index >= 0 else "a GPU NVML did not name"
            log.log(level, "nvml: %s: Xid %d (%s)", where, xid, meaning)
