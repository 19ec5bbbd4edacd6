"""The exporter: sources -> snapshot -> one /metrics target.

Each source (one per vLLM engine, one for the host) is sampled in the
background into an immutable reading; a scrape only renders the latest
snapshot, so a slow or dead source never slows a scrape.
"""
