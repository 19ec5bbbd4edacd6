"""Attacks from the security reviews, as scripts: each runs on its own against a live stack, and the tests run
them against real components (docs/security.md)."""
