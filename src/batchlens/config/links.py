"""The `links:` section: absolute runbook and dashboard URLs for the alerts."""

from __future__ import annotations

from pydantic import Field

from batchlens.config.base import Section, url_setting


class Links(Section):
    """Where alert annotations point. Alerts leave for Slack and PagerDuty, where a relative link leads nowhere."""

    grafana_url: url_setting("https://grafana.example.com") = Field(
        "", description="Grafana's base URL for the alerts' dashboard_url; empty: relative"
    )
    runbook_url: url_setting("https://github.com/batchlens/batchlens/blob/main/docs/runbooks") = Field(
        "", description="base URL of the runbooks (docs/runbooks/ published); empty: relative"
    )
