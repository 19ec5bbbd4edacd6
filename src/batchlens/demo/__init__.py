"""`batchlens demo` (and `make demo`): the whole stack natively, without Docker, in one run folder.

It starts the simulator, a load generator, the exporter, the remediation hook,
Prometheus and Alertmanager, and Grafana when a ``grafana-server`` (or
``grafana``) binary is on the PATH. With a LiteLLM proxy (``make litellm-env``'s,
or one given), it routes the article's way (docs/routing.md): a second simulator
takes the interactive class, the proxy with the batchlens plugin sits in front
of both, and the load goes through it. They run the same provisioning files as
docker compose: `batchlens build` writes the rules, the dashboards and the
provisioning into ``RUN/stack`` with this stack's addresses (see stack.py), from
the installed package alone, so the demo needs no checkout. Each service logs
to ``RUN/logs/<service>.log``. A missing Prometheus, Alertmanager
or Grafana is reported with the command that installs it, and the rest starts.
Ctrl-C (or SIGTERM) stops everything, newest first, and waits for it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from batchlens.artifacts import build
from batchlens.config import Config, load_config
from batchlens.routing.proxy_config import LITELLM_VERSION, SERVER_ARGS, litellm_config
from batchlens.simulator.dialect import DEFAULT_VLLM_VERSION
from batchlens.stack import SERVICES, Address, alertmanager_config, native, template

log = logging.getLogger("batchlens.demo")
BATCHLENS = [sys.executable, "-m", "batchlens"]

INSTALL = {
    "prometheus": "sudo apt-get install -y prometheus   (or https://prometheus.io/download/)",
    "alertmanager": "sudo apt-get install -y prometheus-alertmanager   (or https://prometheus.io/download/)",
    "grafana": "see https://grafana.com/grafana/download (Grafana 11.5 or later)",
    "litellm": "make litellm-env in a batchlens checkout, or pip install 'litellm[proxy]' batchlens",
}
#: The LiteLLM environment `make litellm-env` builds (scripts/litellm-env.sh), with batchlens in it.
LITELLM_ENV = Path.home() / ".cache" / "batchlens" / f"litellm-{LITELLM_VERSION}"
SERVED_MODEL = "deepseek-sim"  # the simulators' default --served-model-name


@dataclass
class Service:
    name: str
    argv: list[str]
    health: str  # URL that answers 200 once the service is up
    env: dict[str, str] = field(default_factory=dict)
    startup_seconds: float = 60  # until its health URL answers
    process: subprocess.Popen | None = None


def find(*names: str) -> str | None:
    return next((path for name in names if (path := shutil.which(name))), None)


def find_litellm(choice: str) -> str | None:
    """``auto``: make litellm-env's proxy (batchlens is in it), else one on the PATH; ``off``: none; else a path."""
    if choice == "off":
        return None
    if choice != "auto":
        if not (Path(choice).is_file() and os.access(choice, os.X_OK)):
            raise RuntimeError(f"--litellm {choice}: no executable there (the `litellm` of an environment "
                               "that has batchlens installed)")  # fmt: skip
        return choice
    built = LITELLM_ENV / "bin" / "litellm"
    return str(built) if built.exists() else find("litellm")


def secret(path: Path) -> str:
    """A token kept in the run folder (0600), made on first use so that restarts keep it."""
    try:  # created 0600, never readable by others even for a moment (a write, then a chmod, left a window)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


class Demo:
    def __init__(self, run_dir: Path, *, offset: int = 0, speed: float = 1.0, rate: float = 2.5,
                 max_num_seqs: int = 64, steer: bool = True, vllm_version: str = DEFAULT_VLLM_VERSION,
                 config: Config | None = None, litellm: str = "auto",
                 overload: tuple[float, float, float] | None = None):  # fmt: skip
        self.run = run_dir.resolve()
        self.stack = self.run / "stack"  # alerts/, dashboards/, provisioning/ as `batchlens build` writes them
        self.config = config or Config()  # its thresholds shape the rules and dashboards
        self.offset, self.speed, self.rate, self.max_num_seqs = offset, speed, rate, max_num_seqs
        self.steer = steer  # run the controller (else the breaker alone acts, as before stage 3)
        self.overload = overload  # (every, seconds, factor) of the load's overload phases, in simulated seconds
        self.vllm_version = vllm_version  # the metric dialect the simulator speaks
        self.address = native(offset)
        # The proxy's binary (find_litellm); None: no routing, the load goes straight to the engine.
        self.litellm, self.litellm_choice = find_litellm(litellm), litellm
        self.services: list[Service] = []
        self.missing: dict[str, str] = {}

    def url(self, service: str) -> str:
        return f"http://{self.address(service)}"

    def targets(self) -> Address:
        """This stack's addresses, for Prometheus: the proxy only where it runs."""
        return lambda service: None if service == "litellm" and not self.litellm else self.address(service)

    def prepare(self) -> list[Service]:
        """Write the run folder's config files and list the services to start, in order."""
        (self.run / "logs").mkdir(parents=True, exist_ok=True)
        build(self.config, self.stack, check=False, address=self.targets())
        admin, webhook = secret(self.run / "admin-token"), self.run / "webhook-token"
        secret(webhook)
        tokens = {"BATCHLENS_ADMIN_TOKEN": admin, "BATCHLENS_WEBHOOK_TOKEN": webhook.read_text().strip()}
        config = self.run / "batchlens.yaml"
        config.write_text(yaml.safe_dump({
            "engines": self.engines(),
            "exporter": {"listen": self.address("exporter"), "nvml": False},  # the simulator is the GPU here
            # The hook acts only on an alert this Prometheus shows firing: one posted to Alertmanager by hand moves
            # nothing (docs/security.md, "What the hook trusts").
            "remediate": {"listen": self.address("remediate"), "state_path": str(self.run / "remediate.sqlite"),
                          "alertmanager_url": self.url("alertmanager"), "prometheus_url": self.url("prometheus")},
            # The controller steers the batch limit; the breaker stays the safety layer around it.
            # With it, the door's queued-token cap: past capacity the engine refuses what would miss its TTFT.
            "control": {"enabled": self.steer, "admission": self.steer, "interval_seconds": 2 / self.speed,
                        "drain_seconds": 30 / self.speed},
            **({"routing": {"model": SERVED_MODEL, "exporter_url": self.url("exporter"),
                            "proxy_url": self.url("litellm"), "metrics_auth": False}} if self.litellm else {}),
        }, sort_keys=False))  # fmt: skip
        services = [self._simulator("simulate", self.max_num_seqs, admin)]
        if self.litellm:  # a small batch for the interactive class, beside the main engine
            services.append(self._simulator("simulate-interactive", 8, admin))
        services += [
            Service("exporter", [*BATCHLENS, "exporter", "--config", str(config)], self.url("exporter") + "/healthz",
                    tokens),
            Service("remediate", [*BATCHLENS, "remediate", "--config", str(config)],
                    self.url("remediate") + "/healthz", tokens),
        ]  # fmt: skip
        load_via: list[str] = []  # the load's flags and env when it goes through the proxy
        load_env: dict[str, str] = {}
        if self.litellm:
            load_env = {"LITELLM_MASTER_KEY": secret(self.run / "litellm-master-key")}
            services.append(self._proxy(config, load_env))
            load_via = ["--api-key-env", "LITELLM_MASTER_KEY", "--text-prompts", "--served-model-name", SERVED_MODEL,
                        "--interactive-share", "0.2"]  # fmt: skip
        elif self.litellm_choice == "auto":
            self.missing["litellm"] = INSTALL["litellm"]
        alertmanager = find("prometheus-alertmanager", "alertmanager")
        if alertmanager:
            am_config = self.run / "alertmanager.yml"
            am_config.write_text(alertmanager_config(template("alertmanager/alertmanager.yml"), self.address,
                                                     str(webhook)))  # fmt: skip
            services.append(Service("alertmanager", [
                alertmanager, f"--config.file={am_config}", f"--storage.path={self.run / 'alertmanager'}",
                f"--web.listen-address={self.address('alertmanager')}", "--cluster.listen-address=",
            ], self.url("alertmanager") + "/-/ready"))  # fmt: skip
        else:
            self.missing["alertmanager"] = INSTALL["alertmanager"]
        prometheus = find("prometheus")
        if prometheus:
            services.append(Service("prometheus", [
                # Its rule and target paths are relative to the file, and the build put them beside it.
                prometheus, f"--config.file={self.stack / 'provisioning' / 'prometheus' / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.run / 'prometheus' / 'data'}",
                f"--web.listen-address={self.address('prometheus')}",
            ], self.url("prometheus") + "/-/ready"))  # fmt: skip
            services.append(Service("report", [
                *BATCHLENS, "report", "--prometheus", self.url("prometheus"), "--watch", "--every", "10",
                "--listen", self.address("report"),
            ], self.url("report") + "/healthz"))  # fmt: skip
        else:
            self.missing["prometheus"] = INSTALL["prometheus"]
        grafana = find("grafana-server", "grafana")
        if grafana:
            services.append(self._grafana(grafana))
        else:
            self.missing["grafana"] = INSTALL["grafana"]
        services.append(Service("load", [
            *BATCHLENS, "load", "--url", self.url("litellm" if self.litellm else "simulate"), "--rate", str(self.rate),
            "--duration", "86400", "--arrival", "bursty", "--output-tokens", "64,128,256", *load_via,
            *self._overload_flags(),
        ], "", load_env))  # fmt: skip
        return services

    def _overload_flags(self) -> list[str]:
        if self.overload is None:
            return []
        every, seconds, factor = self.overload
        return ["--overload-every", f"{every / self.speed:g}", "--overload-seconds", f"{seconds / self.speed:g}",
                "--overload-factor", f"{factor:g}"]  # fmt: skip

    def engines(self) -> list[dict]:
        if not self.litellm:
            return [{"name": "demo", "url": self.url("simulate"), "simulated_gpu": True}]
        return [
            {"name": "demo", "url": self.url("simulate"), "simulated_gpu": True, "role": ["main", "long", "cold"]},
            {"name": "demo-interactive", "url": self.url("simulate-interactive"), "simulated_gpu": True,
             "role": "interactive"},
        ]  # fmt: skip

    def _simulator(self, name: str, max_num_seqs: int, admin: str) -> Service:
        return Service(name, [*BATCHLENS, "simulate", "--listen", self.address(name), "--speed", str(self.speed),
                              "--max-num-seqs", str(max_num_seqs), "--vllm-version", self.vllm_version],
                       self.url(name) + "/health", {"BATCHLENS_ADMIN_TOKEN": admin})  # fmt: skip

    def _proxy(self, config: Path, key: dict[str, str]) -> Service:
        """The LiteLLM proxy with the config `batchlens build` would write for these engines, and the plugin."""
        proxy = self.run / "litellm.yaml"
        proxy.write_text(yaml.safe_dump(litellm_config(load_config(config, environ={})), sort_keys=False))
        host, port = self.address("litellm").rsplit(":", 1)
        # Offline, LiteLLM would spend seconds fetching its model cost map from GitHub first.
        env = {**key, "BATCHLENS_CONFIG": str(config), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        argv = [self.litellm, "--config", str(proxy), "--host", host, "--port", port, *SERVER_ARGS]
        return Service("litellm", argv, self.url("litellm") + "/health/liveliness", env, startup_seconds=120)

    def _grafana(self, binary: str) -> Service:
        home = next((p for p in ("/usr/share/grafana", "/usr/local/share/grafana") if Path(p).is_dir()), None)
        argv = [binary, *(["server"] if binary.endswith("/grafana") else []), *(["--homepath", home] if home else [])]
        env = {
            "GF_PATHS_PROVISIONING": str(self.stack / "provisioning" / "grafana"),
            "GF_PATHS_DATA": str(self.run / "grafana"),
            "GF_SERVER_HTTP_ADDR": "127.0.0.1", "GF_SERVER_HTTP_PORT": str(3000 + self.offset),
            "BATCHLENS_PROMETHEUS_URL": self.url("prometheus"), "BATCHLENS_ALERTMANAGER_URL": self.url("alertmanager"),
            "BATCHLENS_DASHBOARDS_DIR": str(self.stack / "dashboards"),
        }  # fmt: skip
        return Service("grafana", argv, self.url("grafana") + "/api/health", env)

    def log_path(self, service: Service) -> Path:
        return self.run / "logs" / f"{service.name}.log"

    def why(self, service: Service) -> str:
        """A dead service's exit code and the last line of its log: the reason, not only where to find it."""
        try:
            lines = [line for line in self.log_path(service).read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        last = lines[-1].strip() if lines else "(its log is empty)"
        return f"{service.name} exited with {service.process.returncode}: {last} (log: {self.log_path(service)})"

    def check_ports(self, services: list[Service]) -> None:
        """Every port is free before anything starts: a stranger on a port would answer our health checks."""
        for service in services:
            if service.name not in SERVICES:
                continue
            host, port = self.address(service.name).rsplit(":", 1)
            with socket.socket() as probe:
                try:
                    probe.bind((host, int(port)))
                except OSError as exc:
                    raise RuntimeError(
                        f"port {port} ({service.name}) on {host} is taken ({exc.strerror}): stop what listens there, "
                        "or run with --port-offset N"
                    ) from None

    def start(self) -> None:
        services = self.prepare()
        self.check_ports(services)
        for service in services:
            out = open(self.log_path(service), "ab")  # noqa: SIM115 - the child owns it
            service.process = subprocess.Popen(
                service.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **service.env}, cwd=self.run, process_group=0,
            )  # fmt: skip
            out.close()
            self.services.append(service)
            if service.health:
                self._wait(service, service.startup_seconds)
            log.info("%s started (pid %d)", service.name, service.process.pid)

    def _wait(self, service: Service, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if service.process.poll() is not None:
                raise RuntimeError(self.why(service))
            try:
                with urllib.request.urlopen(service.health, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{service.name} did not answer {service.health} within {timeout:.0f} s")

    def summary(self) -> str:
        lines = ["batchlens demo is running. Ctrl-C stops it.", f"  run folder   {self.run}"]
        urls = {
            "simulate": "/v1/models", "simulate-interactive": "/v1/models", "litellm": "/metrics/",
            "exporter": "/metrics", "remediate": "/healthz", "report": "/",
            "prometheus": self.prometheus_alerts_page(), "alertmanager": "/#/alerts", "grafana": "/dashboards",
        }  # fmt: skip
        for service in self.services:
            if service.name in urls:
                lines.append(f"  {service.name:<12} {self.url(service.name)}{urls[service.name]}")
        for name, how in self.missing.items():
            lines.append(f"  {name:<12} not found, not started: {how}")
        return "\n".join(lines)

    def prometheus_alerts_page(self) -> str:
        """Prometheus' alerts page: /alerts where its web UI is built in, /classic/alerts where it is not (Debian's
        2.42 ships without the React UI, and answers /alerts with 404)."""
        try:
            with urllib.request.urlopen(self.url("prometheus") + "/alerts", timeout=2) as reply:
                return "/alerts" if reply.status == 200 else "/classic/alerts"
        except OSError:  # HTTPError (404) included
            return "/classic/alerts"

    def status(self) -> dict:
        return {s.name: {"pid": s.process.pid, "alive": s.process.poll() is None} for s in self.services}

    def stop(self, timeout: float = 15) -> None:
        for service in reversed(self.services):
            if service.process.poll() is None:
                os.killpg(service.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for service in reversed(self.services):
            try:
                service.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing it", service.name, timeout)
                os.killpg(service.process.pid, signal.SIGKILL)
                service.process.wait(10)
        (self.run / "status.json").write_text(json.dumps(self.status()))


def run(demo: Demo) -> None:
    """Start, print the URLs, wait for Ctrl-C or SIGTERM, stop. A service that dies raises, with its reason."""
    stopping = []
    # Both stop it, even where its parent started it with SIGINT ignored (nohup, a background job of a script):
    # Python leaves an inherited SIG_IGN in place, and Ctrl-C would then do nothing.
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    failed = None
    try:
        demo.start()
        print(demo.summary(), flush=True)
        (demo.run / "status.json").write_text(json.dumps(demo.status()))
        while not stopping:
            dead = [s for s in demo.services if s.process.poll() is not None and s.name != "load"]
            if dead:
                failed = "; ".join(demo.why(s) for s in dead)
                log.error("%s: stopping the demo", failed)
                break
            time.sleep(0.5)
    finally:
        if demo.services:
            print("stopping ...", flush=True)
            demo.stop()
            print("stopped", flush=True)
    if failed:
        raise RuntimeError(failed)
