"""A vLLM-compatible engine with a simulated GPU, for demos and tests without a GPU."""
