"""The batchlens exporter as a real subprocess, scraped over real HTTP.

Tests read its output with prometheus_client's parser, not ours, so the
exporter's own parser is never its own judge.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.procs import Process, free_port, http_get

BATCHLENS = str(Path(sys.executable).parent / "batchlens")

#: A parsed scrape: (sample name, frozenset of label pairs) -> value.
Samples = dict[tuple[str, frozenset], float]


def parse_samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def pick(samples: Samples, name: str, **labels: str) -> dict[frozenset, float]:
    """The samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return {lbl: v for (n, lbl), v in samples.items() if n == name and want <= lbl}


def one(samples: Samples, name: str, **labels: str) -> float:
    found = pick(samples, name, **labels)
    assert len(found) == 1, f"expected one {name}{labels}, found {len(found)}: {sorted(found)[:5]}"
    return next(iter(found.values()))


class ExporterProcess:
    def __init__(
        self,
        workdir: Path,
        engines: Sequence[str],
        *,
        interval: float = 0.5,
        timeout: float = 1.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [BATCHLENS, "exporter", "--listen", f"127.0.0.1:{self.port}"]
        argv += ["--interval", str(interval), "--timeout", str(timeout), *extra_args]
        for engine in engines:
            argv += ["--engine", engine]
        self.interval = interval
        self.process = Process("exporter", argv, workdir / f"exporter-{self.port}.log", env=dict(env or {}))
        self.process.wait_http(self.url + "/healthz", timeout=30)

    def scrape(self) -> tuple[float, str]:
        """One scrape of /metrics: (seconds it took, body)."""
        t0 = time.monotonic()
        status, body = http_get(self.url + "/metrics", timeout=30)
        elapsed = time.monotonic() - t0
        assert status == 200, f"/metrics answered {status}: {body[:200]!r}"
        return elapsed, body.decode()

    def samples(self) -> Samples:
        return parse_samples(self.scrape()[1])

    def wait_for(self, predicate: Callable[[Samples], bool], timeout: float = 20, what: str = "condition") -> Samples:
        deadline = time.monotonic() + timeout
        while True:
            samples = self.samples()
            if predicate(samples):
                return samples
            if time.monotonic() > deadline:
                pytest.fail(f"exporter: {what} not reached within {timeout}s\n{self.process.log_tail()}")
            time.sleep(self.interval / 2)

    def rss_bytes(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss

    def stop(self) -> int:
        return self.process.stop()
