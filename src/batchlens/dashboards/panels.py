"""The two panels grafanalib lacks, for Grafana 11.5: the XY chart and the current heatmap.

grafanalib 0.7 has no XY chart, and its Heatmap writes the pre-9 options that
Grafana migrates on load. Both classes here write the current JSON and set
``pluginVersion``: a panel without it is taken for an old save and migrated,
which for the XY chart rewrites the series mapping and breaks it.
"""

from __future__ import annotations

import attr
from grafanalib.core import Panel

#: Grafana's own version the panels are written for; 11.1 is the oldest that reads this XY chart JSON.
PLUGIN_VERSION = "11.5.0"


def by_name(name: str) -> dict:
    return {"matcher": {"id": "byName", "options": name}}


@attr.s
class XYChart(Panel):
    """A scatter chart: one point per row, x and y from two fields, color and size from two more.

    ``mapping="auto"`` applies the one field mapping to every frame the
    transformations produce, so a partition by label gives one series per label value.
    """

    x = attr.ib(default="x")
    y = attr.ib(default="y")
    color = attr.ib(default=None)
    size = attr.ib(default=None)
    x_unit = attr.ib(default="short")
    y_unit = attr.ib(default="short")
    color_unit = attr.ib(default="percentunit")
    point_size = attr.ib(default=(4, 16))

    def fields(self) -> dict[str, str]:
        """dimension -> the field name it reads (what the transformations must produce)."""
        dims = {"x": self.x, "y": self.y, "color": self.color, "size": self.size}
        return {dim: name for dim, name in dims.items() if name}

    def to_json_data(self) -> dict:
        low, high = self.point_size
        return self.panel_json(
            {
                "type": "xychart",
                "pluginVersion": PLUGIN_VERSION,
                "options": {
                    "mapping": "auto",
                    "series": [{dim: by_name(name) for dim, name in self.fields().items()}],
                    "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "single", "sort": "none"},
                },
                "fieldConfig": {
                    "defaults": {
                        "color": {"mode": "continuous-GrYlRd"},
                        "custom": {
                            "show": "points",
                            "pointShape": "circle",
                            "pointSize": {"fixed": low, "min": low, "max": high},
                            "fillOpacity": 60,
                            "axisPlacement": "auto",
                        },
                        "min": 0,
                    },
                    "overrides": [
                        {**by_name(name), "properties": [{"id": "unit", "value": unit}]}
                        for name, unit in ((self.x, self.x_unit), (self.y, self.y_unit), (self.color, self.color_unit))
                        if name
                    ],
                },
            }
        )


@attr.s
class Heatmap(Panel):
    """A heatmap of pre-bucketed Prometheus histograms (targets with format "heatmap")."""

    unit = attr.ib(default="s")

    def to_json_data(self) -> dict:
        return self.panel_json(
            {
                "type": "heatmap",
                "pluginVersion": PLUGIN_VERSION,
                "options": {
                    "calculate": False,
                    "yAxis": {"unit": self.unit, "axisPlacement": "left"},
                    "rowsFrame": {"layout": "le"},
                    "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5},
                    "cellGap": 1,
                    "tooltip": {"mode": "single", "yHistogram": True},
                    "legend": {"show": True},
                    "exemplars": {"color": "rgba(255,0,255,0.7)"},
                },
                "fieldConfig": {"defaults": {}, "overrides": []},
            }
        )
