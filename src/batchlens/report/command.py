"""`batchlens report`: the click wiring. The work is in data.py and render.py."""

from __future__ import annotations

import click

from batchlens.clikit import (
    config_option,
    duration,
    prometheus_option,
    prometheus_timeout_option,
    range_option,
    writable_folder,
)
from batchlens.clikit import load as load_or_fail
from batchlens.masking import mask_url


@click.command()
@config_option
@prometheus_option
@range_option
@prometheus_timeout_option
@click.option("--out", type=click.Path(file_okay=False), default="batchlens-report", show_default=True,
              help="Folder for report.png and report.html.")  # fmt: skip
@click.option("--watch", is_flag=True,
              help="Serve the report on a local page, redrawn every --every seconds, until Ctrl-C.")  # fmt: skip
@click.option("--listen", metavar="HOST:PORT", default="127.0.0.1:9402", show_default=True,
              help="With --watch: where the page is served.")  # fmt: skip
@click.option("--every", type=click.FloatRange(min=1), default=15.0, show_default=True, metavar="SECONDS",
              help="With --watch: how often the page is redrawn (and the browser reloads it).")  # fmt: skip
def report(config_path: str | None, prometheus_url: str, range_: str, timeout: float, out: str, watch: bool,
           listen: str, every: float) -> None:  # fmt: skip
    """Write the batch efficiency trend report: a PNG and an HTML page.

    It shows what the overview dashboard shows, without Grafana: the operating
    points (throughput against P99, colored by GPU memory busy), the batch
    efficiency decay (tokens/s per running sequence against the batch), KV
    blocks and GPU memory busy over time, and a table of averages per batch
    limit. The thresholds and the P99 latency come from the config.

    --range is how far back it may look: on a young deployment the report
    starts where the data starts, and its step follows the span it covers
    (about 600 points), so a short history is drawn in detail. It needs
    batchlens' recording rules (alerts/batchlens.rules.yml) in Prometheus.

    --watch serves the same view on a page that redraws itself, with the
    breaker's and the controller's actions: the dashboards without Grafana
    (`batchlens demo` runs it). A Prometheus that fails leaves the last good
    picture up, with what went wrong above it.

    \b
    Examples:
      batchlens report --prometheus http://127.0.0.1:9090 --range 6h --out report/
      batchlens report --prometheus http://127.0.0.1:9090 --watch   # http://127.0.0.1:9402/
    """
    import asyncio
    import time

    import aiohttp

    from batchlens.prometheus_api import Prometheus, PrometheusError, step_for
    from batchlens.report.data import available, fetch
    from batchlens.report.render import write

    config = load_or_fail(config_path, {})
    seconds = duration(range_, "--range")
    if watch:
        return _watch(prometheus_url, config.thresholds, seconds, timeout, listen, every)
    folder = writable_folder(out, "--out")

    async def load():
        async with aiohttp.ClientSession() as session:
            prometheus = Prometheus(session, prometheus_url, timeout)
            start, end = await available(prometheus, config.thresholds, seconds, time.time())
            return await fetch(prometheus, config.thresholds, start, end, step_for(end - start, REPORT_POINTS))

    try:
        data = asyncio.run(load())
    except PrometheusError as exc:
        raise click.ClickException(str(exc)) from None
    png, page = write(data, folder)
    click.echo(f"wrote {png} and {page} ({sum(len(p) for p in data.points.values())} points over "
               f"{data.end - data.start:.0f} s, {len(data.points)} engines)")  # fmt: skip


REPORT_POINTS = 600


def _watch(prometheus_url: str, thresholds, seconds: float, timeout: float, listen: str, every: float) -> None:
    import logging

    from batchlens.config import parse_listen
    from batchlens.http_server import run_app
    from batchlens.report.live import LiveReport

    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    live = LiveReport(prometheus_url, thresholds, seconds=seconds, timeout=timeout, every=every)
    logger = logging.getLogger("batchlens.report")
    try:
        source = mask_url(prometheus_url)
        run_app(live.app(), host, port, logger=logger, access_log=None,
                ready=f"report page on http://{listen}/ (from {source}, every {every:g} s)")  # fmt: skip
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc.strerror or exc}") from None
