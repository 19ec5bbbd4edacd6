"""The exporter's resident memory with its own HTTP server (h11) against prometheus_client's, the ecosystem's usual
server for an exporter: the same Exporter, the same 8 engines, scraped alike.

    python benchmarks/exporter_server.py [--engines 8] [--interval 1] [--minutes 3] [--scrape-every 5]

prometheus_client's server (`start_wsgi_server`: wsgiref on a ThreadingWSGIServer) renders a registry; the
exporter's body also passes every engine's own samples through as text, so the stand-in serves `Exporter.body()`
through that same server class with a WSGI app of three lines. The engines are upstreams
(tests/harness/upstreams.py) serving a real vLLM 0.32 exposition. The goal is 50 MiB or less at 8 engines.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.exporter import ExporterProcess  # noqa: E402
from harness.procs import free_port, http_get  # noqa: E402
from harness.upstreams import Upstreams  # noqa: E402

MiB = 2**20

# The exporter's sampling, served by prometheus_client's own server class.
WSGI_EXPORTER = """
import asyncio, sys, threading
from wsgiref.simple_server import make_server
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from batchlens.config import load_config
from batchlens.exporter.server import Exporter

port, interval, engines = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
config = load_config(None, {"engines": [{"name": n, "url": u} for n, u in (e.split("=", 1) for e in engines)],
                            "exporter": {"interval_seconds": interval, "timeout_seconds": 2, "nvml": False}}, {})
exporter = Exporter(config)

def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8")])
    return [exporter.body()]

server = make_server("127.0.0.1", port, app, ThreadingWSGIServer, handler_class=_SilentHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()

async def main():
    await exporter.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def measure(pid: int, url: str, minutes: float, scrape_every: float) -> tuple[float, float, float]:
    """(median RSS over the last minute, peak RSS, median scrape ms) while scraping ``url``."""
    rss, took = [], []
    end = time.monotonic() + minutes * 60
    while time.monotonic() < end:
        started = time.perf_counter()
        status, _ = http_get(url, timeout=10)
        took.append((time.perf_counter() - started) * 1e3)
        assert status == 200, status
        rss.append(psutil.Process(pid).memory_info().rss)
        time.sleep(scrape_every)
    last = rss[-max(1, int(60 / scrape_every)) :]
    return statistics.median(last), max(rss), statistics.median(took)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--scrape-every", type=float, default=5.0)
    args = parser.parse_args()

    text = (ROOT / "tests" / "data" / "vllm-0.32.0-cpu.prom").read_text()
    upstreams = Upstreams()
    engines = [f"e{i}={upstreams.add(f'e{i}', text=text)}" for i in range(args.engines)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ours = ExporterProcess(
            Path(tmp), engines, interval=args.interval, timeout=2, env={"BATCHLENS_EXPORTER__NVML": "false"}
        )  # as the stand-in: no NVML source
        try:
            rows.append(("h11 (batchlens)", *measure(ours.process.pid, ours.url + "/metrics", args.minutes,
                                                     args.scrape_every)))  # fmt: skip
        finally:
            ours.stop()
        port = free_port()
        theirs = subprocess.Popen([sys.executable, "-c", WSGI_EXPORTER, str(port), str(args.interval), *engines],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if http_get(f"http://127.0.0.1:{port}/metrics")[0] == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            rows.append(("prometheus_client (wsgiref)", *measure(theirs.pid, f"http://127.0.0.1:{port}/metrics",
                                                                 args.minutes, args.scrape_every)))  # fmt: skip
        finally:
            theirs.terminate()
            theirs.wait(10)
    upstreams.close()
    print(f"engines {args.engines}, interval {args.interval}s, {args.minutes:g} min each, a scrape every "
          f"{args.scrape_every:g}s")  # fmt: skip
    print(f"{'server':<28} {'rss MiB':>8} {'peak MiB':>9} {'scrape ms':>10}")
    for name, rss, peak, took in rows:
        print(f"{name:<28} {rss / MiB:>8.1f} {peak / MiB:>9.1f} {took:>10.2f}")
    print(f"ratio prometheus_client / h11: {rows[1][1] / rows[0][1]:.2f} (rss)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
