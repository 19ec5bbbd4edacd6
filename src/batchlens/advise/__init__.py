"""``batchlens advise``: the article's continuous-batching decision table, computed from Prometheus.

:mod:`~batchlens.advise.evidence` asks Prometheus (I/O);
:mod:`~batchlens.advise.decide` turns the evidence into criteria and
recommended settings, each with the figures behind it (pure).
"""
