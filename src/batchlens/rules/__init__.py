"""Prometheus recording and alert rules as code: ``batchlens build`` writes them to alerts/*.yml."""
