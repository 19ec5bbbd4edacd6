"""``batchlens load``: an open-loop load generator for any OpenAI-compatible server."""
