"""Settings and thresholds: the one source of truth for every batchlens component.

Values are layered, later layers winning:

1. the defaults below (the article's thresholds, loopback listeners);
2. the YAML file given with ``--config`` (or env ``BATCHLENS_CONFIG``);
3. environment variables ``BATCHLENS_<SECTION>__<KEY>``, for example
   ``BATCHLENS_EXPORTER__INTERVAL_SECONDS=2``, and ``BATCHLENS_ENGINES`` holding a
   YAML/JSON list of engines;
4. command-line flags.

The file names the environment variables that hold tokens; it never holds a token.

One module per section (exporter.py, breaker.py, ...), their shared blocks in base.py, the whole in model.py,
the layering in loading.py and what `config show` prints in masked.py. It imports no feature package: they
import it.
"""

from __future__ import annotations

from batchlens.config.base import (
    ENV_PREFIX,
    ConfigError,
    duration_seconds,
    http_url,
    parse_listen,
    url_setting,
    yaml_problem,
)
from batchlens.config.breaker import Breaker
from batchlens.config.control import Control
from batchlens.config.engines import ROLES, Engine, by_instance, parse_engine_flag
from batchlens.config.exporter import Exporter
from batchlens.config.kubernetes import LWS_GROUP, LWS_NAME, Kubernetes, SecretToFill
from batchlens.config.links import Links
from batchlens.config.loading import load_config
from batchlens.config.masked import masked_dump, url_settings
from batchlens.config.model import Config
from batchlens.config.remediate import LeaderElection, Remediate
from batchlens.config.routing import Routing
from batchlens.config.thresholds import Thresholds
from batchlens.goodput import Slo

__all__ = [
    "ENV_PREFIX",
    "LWS_GROUP",
    "LWS_NAME",
    "ROLES",
    "Breaker",
    "Config",
    "ConfigError",
    "Control",
    "Engine",
    "Exporter",
    "Kubernetes",
    "LeaderElection",
    "Links",
    "Remediate",
    "Routing",
    "SecretToFill",
    "Slo",
    "Thresholds",
    "by_instance",
    "duration_seconds",
    "http_url",
    "load_config",
    "masked_dump",
    "parse_engine_flag",
    "parse_listen",
    "url_setting",
    "url_settings",
    "yaml_problem",
]
