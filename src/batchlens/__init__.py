"""batchlens: observability and remediation for vLLM's batch-size trade-off."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("batchlens")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
