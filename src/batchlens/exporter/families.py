"""Small builders for prometheus_client metric families.

Derived and status metrics are rendered by prometheus_client from a snapshot
(the Collector protocol); these helpers keep their construction to one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.metrics_core import Metric

LabeledValue = tuple[Mapping[str, str], float]


def _family(name: str, doc: str, typ: str, sample_name: str, samples: Iterable[LabeledValue]) -> Metric:
    metric = Metric(name, doc, typ)
    for labels, value in samples:
        metric.add_sample(sample_name, dict(labels), float(value))
    return metric


def gauge(name: str, doc: str, samples: Iterable[LabeledValue]) -> Metric:
    return _family(name, doc, "gauge", name, samples)


def counter(name: str, doc: str, samples: Iterable[LabeledValue]) -> Metric:
    """A counter; ``name`` is the exposed name and must end in ``_total``."""
    if not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end in _total")
    return _family(name[: -len("_total")], doc, "counter", name, samples)


def info(name: str, doc: str, labels: Mapping[str, str]) -> Metric:
    """An info metric: a gauge of 1 that carries facts as labels (``name`` ends in ``_info``)."""
    return gauge(name, doc, [(labels, 1.0)])
