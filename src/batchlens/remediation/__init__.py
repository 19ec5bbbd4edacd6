"""The remediation hook: Alertmanager webhook -> P99 breaker -> the vLLM admin API."""
