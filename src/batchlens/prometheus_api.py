"""A small typed client of Prometheus' HTTP API (v1), for the commands that read it: report and advise.

Every failure becomes a :class:`PrometheusError` that says what was asked, what
was expected and what came back: a refused query, a server that is not a
Prometheus, one that never answers. The commands print it as one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import aiohttp

from batchlens.masking import mask_url

#: Prometheus refuses a range query of more than 11,000 points per series.
MAX_POINTS = 11_000
DEFAULT_TIMEOUT = 30.0


class PrometheusError(Exception):
    """A query could not be answered: the message says why, in one line."""


@dataclass
class Prometheus:
    session: aiohttp.ClientSession
    url: str  # base URL, e.g. http://127.0.0.1:9090
    timeout: float = DEFAULT_TIMEOUT

    async def _get(self, path: str, params: dict[str, str] | None = None) -> dict:
        url = f"{self.url.rstrip('/')}{path}"
        shown = mask_url(url)  # the messages below are logged, and shown on the report's page
        try:
            async with self.session.get(url, params=params, timeout=aiohttp.ClientTimeout(total=self.timeout)) as reply:
                status, kind = reply.status, reply.headers.get("Content-Type", "no content type")
                text = await reply.text(errors="replace")
        except TimeoutError:
            raise PrometheusError(f"{shown} did not answer within {self.timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise PrometheusError(f"cannot read {shown}: {exc or type(exc).__name__}") from None
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not isinstance(body, dict) or "status" not in body:
            raise PrometheusError(
                f"{shown} is not a Prometheus API: expected its JSON, got HTTP {status} ({kind}) {text[:60].strip()!r}"
            )
        if body["status"] != "success":
            raise PrometheusError(f"Prometheus refused {params or path}: HTTP {status}: {body.get('error')}")
        return body["data"]

    async def instant(self, expr: str, at: float) -> dict[str, float]:
        """An instant query -> vllm_instance -> value (NaN kept: it means "no data in the range")."""
        return {labels.get("vllm_instance", ""): value for labels, value in await self.vector(expr, at)}

    async def vector(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query -> (labels, value) per series; at Prometheus' own now without ``at``."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = await self._get("/api/v1/query", params)
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
            raise PrometheusError(f"expected a vector for {expr!r}, got {kind!r}")
        try:
            return [({str(k): str(v) for k, v in s["metric"].items()}, float(s["value"][1])) for s in data["result"]]
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise PrometheusError(f"a malformed vector for {expr!r}: {type(exc).__name__} {exc}") from None

    async def samples(self, selector: str, seconds: float, at: float) -> list[tuple[dict[str, str], list[tuple]]]:
        """Every raw sample of ``selector`` in the ``seconds`` before ``at``: (labels, [(time, value), ...]) per
        series, as stored (no step, no interpolation)."""
        window = f"{selector}[{max(1, round(seconds))}s]"  # a range vector: a matrix, as a range query answers
        try:
            series = parse_series(await self._get("/api/v1/query", {"query": window, "time": f"{at:.3f}"}))
        except ValueError as exc:
            raise PrometheusError(f"{exc}, for {window!r}") from None
        return [(labels, sorted(values.items())) for labels, values in series]

    async def range(self, expr: str, start: float, end: float, step: float) -> dict[str, dict[float, float]]:
        """A range query -> vllm_instance -> timestamp -> value, NaN dropped."""
        return by_instance(await self.matrix(expr, start, end, step))

    async def matrix(self, expr: str, start: float, end: float, step: float) -> list[tuple[dict, dict]]:
        """A range query -> (labels, timestamp -> value) per series, NaN dropped."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"}
        try:
            return parse_series(await self._get("/api/v1/query_range", params))
        except ValueError as exc:
            raise PrometheusError(f"{exc}, for {expr!r}") from None

    async def recording_rules(self) -> set[str]:
        """The names of the recording rules Prometheus has loaded."""
        data = await self._get("/api/v1/rules", {"type": "record"})
        return {rule["name"] for group in data.get("groups", []) for rule in group.get("rules", [])}

    async def first_sample(self, expr: str, start: float, end: float) -> float | None:
        """When ``expr`` first has data between ``start`` and ``end``, to the second, or None.

        A coarse pass over the whole span, then a one-second pass over the coarse step before what it
        found: the answer must not move with the grid that ``end`` happens to put the coarse steps on.
        """
        step = step_for(end - start, MAX_POINTS)
        first = await self._first(expr, start, end, step)
        if first is None or step <= 1.0:
            return first
        return await self._first(expr, max(start, first - step), first, 1.0) or first

    async def _first(self, expr: str, start: float, end: float, step: float) -> float | None:
        series = await self.range(expr, start, end, step)
        return min((min(values) for values in series.values() if values), default=None)


def parse_matrix(data: dict) -> dict[str, dict[float, float]]:
    """A range query's result (resultType matrix) -> vllm_instance -> timestamp -> value; NaN dropped."""
    return by_instance(parse_series(data))


def by_instance(series: list[tuple[dict[str, str], dict[float, float]]]) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = {}
    for labels, values in series:
        out.setdefault(labels.get("vllm_instance", ""), {}).update(values)
    return out


def parse_series(data: dict) -> list[tuple[dict[str, str], dict[float, float]]]:
    """A range query's result (resultType matrix) -> (labels, timestamp -> value) per series; NaN dropped."""
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"expected a matrix from Prometheus, got {kind!r}")
    try:
        return [(series["metric"], {float(t): float(v) for t, v in series["values"] if not math.isnan(float(v))})
                for series in data["result"]]  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a malformed matrix: {type(exc).__name__} {exc}") from None


def step_for(seconds: float, points: int) -> float:
    """A query step that gives about ``points`` points over ``seconds``: at least 1 s, and within Prometheus' cap."""
    return max(seconds / points, seconds / (MAX_POINTS - 1000), 1.0)
