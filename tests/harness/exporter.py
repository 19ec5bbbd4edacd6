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


def scraped_sum(url: str, name: str, **labels: str) -> float:
    """``name``'s samples (with ``labels``) summed, from one scrape of ``url``/metrics: an engine's own counters."""
    status, body = http_get(url + "/metrics")
    assert status == 200, f"{url}/metrics answered {status}"
    return sum(pick(parse_samples(body.decode()), name, **labels).values())


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


MONOTONIC_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def _kinds(text: str) -> dict[str, str]:
    """Sample name -> 'counter' (monotonic) or 'gauge', from vLLM's own type lines."""
    kinds = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            monotonic = s.name.endswith(MONOTONIC_SUFFIXES.get(family.type, ()))
            kinds[s.name] = "counter" if monotonic else "gauge"
    return kinds


def _without_instance(samples: Samples, instance: str, vllm_names: set[str]) -> Samples:
    """The engine's samples without the added label, less the exporter's own batchlens_* series.

    The batchlens vLLM plugin exports batchlens_* series of its own (the arrival series) from inside
    vLLM: those are vLLM's samples like any other and must pass through.
    """
    label = ("vllm_instance", instance)
    return {
        (n, lbl - {label}): v
        for (n, lbl), v in samples.items()
        if label in lbl and (n in vllm_names or not n.startswith("batchlens_"))
    }


def compare(vllm_text: str, exported: Samples, instance: str, *, quiescent: bool) -> None:
    """Every vLLM sample is in the exporter's output with the added label; counters equal or grown.

    Under load, vLLM may create series between its scrape and the exporter's (the
    first request of a kind creates its http_* series), so the exporter's set may
    only be larger. Once quiescent, the series sets and every gauge must be equal.
    """
    vllm = parse_samples(vllm_text)
    kinds = _kinds(vllm_text)
    mine = _without_instance(exported, instance, {name for name, _ in vllm})
    missing = set(vllm) - set(mine)
    assert not missing, f"{len(missing)} vLLM samples missing, e.g. {sorted(missing, key=str)[:3]}"
    if quiescent:
        assert set(vllm) == set(mine), f"extra series: {sorted(set(mine) - set(vllm), key=str)[:3]}"
    for key, value in vllm.items():
        name = key[0]
        if kinds[name] == "counter":
            assert mine[key] >= value, f"counter {key} went back: {mine[key]} < {value}"
        elif quiescent and not name.startswith("process_"):
            # process_* gauges (RSS, open fds) move on their own between two scrapes.
            assert mine[key] == value or (value != value and mine[key] != mine[key]), f"gauge {key}"
