"""A refusal that finds another engine, through the real LiteLLM proxy (make litellm-env) and the plugin's wheel.

Two simulator engines of the role main and one interactive engine, each answering the door's 503 as vLLM does
(batchlens.queued_caps) once its admin API caps it at one unfinished request. The exporter is not running, so
every engine's signals are unknown (usable): where the retry goes rests on the plugin's record of the request
alone. docs/routing.md, "A refusal that finds another engine".
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import urllib.error
import urllib.request

import pytest
import yaml

from batchlens.config import load_config
from batchlens.queued_caps import MESSAGES
from batchlens.routing.proxy_config import litellm_config
from harness.exporter import parse_samples, pick, scraped_sum
from harness.litellm import MASTER_KEY, LitellmProxy
from harness.procs import wait_until
from harness.simulator import SIM_TOKEN, SimulatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.litellm, pytest.mark.slow]
LONG_ANSWER = {"model": "deepseek-sim", "prompt": "hello", "max_tokens": 3000}  # about 35 s at speed 1


def admission(engine: SimulatorProcess, caps: dict | None = None) -> dict:
    request = urllib.request.Request(engine.url + "/batchlens/v1/admission", method="PUT" if caps else "GET",
                                     data=json.dumps(caps).encode() if caps else None,
                                     headers={"Authorization": f"Bearer {SIM_TOKEN}"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.load(resp)


def in_background(call) -> None:
    def run() -> None:
        with contextlib.suppress(Exception):  # the engines and the proxy stop under it at the end of the test
            call()

    threading.Thread(target=run, daemon=True).start()


def refused(engine: SimulatorProcess) -> float:
    return scraped_sum(engine.url, "vllm:admission_rejections_total")


def door_retries(proxy: LitellmProxy) -> dict[tuple[str, str], float]:
    found = pick(parse_samples(proxy.metrics()), "batchlens_routing_door_retries_total")
    return {(dict(k)["role"], dict(k)["outcome"]): v for k, v in found.items() if v}


def test_a_door_refusal_is_served_by_another_engine_of_its_role_or_answered_503_with_retry_after(
    tmp_path, litellm_env
) -> None:
    engines = {name: SimulatorProcess(tmp_path, speed=1) for name in ("x", "y", "fast")}
    listed = [{"name": "x", "url": engines["x"].url, "role": "main"},
              {"name": "y", "url": engines["y"].url, "role": "main"},
              {"name": "fast", "url": engines["fast"].url, "role": "interactive"}]  # fmt: skip
    path = tmp_path / "batchlens.yaml"
    routing = {"model": "deepseek-sim", "exporter_url": "http://127.0.0.1:9", "cold_gap": 600}
    path.write_text(yaml.safe_dump({"engines": listed, "routing": routing, "slo": {"ttft_seconds": 30}}))
    proxy = LitellmProxy(tmp_path, litellm_config(load_config(path, environ={})), path, litellm_env)
    try:
        # One long answer through the proxy: LiteLLM's least-busy counts it in flight on the main engine it took
        # (roomy), so it sends the next request to the other (full), which holds one long answer of its own,
        # sent to it directly, under a cap of one unfinished request.
        in_background(lambda: proxy.complete("hello", max_tokens=LONG_ANSWER["max_tokens"]))
        wait_until(lambda: sum(admission(engines[n])["num_unfinished_reqs"] for n in ("x", "y")) == 1, timeout=10,
                   what="the long answer through the proxy to start")  # fmt: skip
        roomy, full = sorted(("x", "y"), key=lambda n: -admission(engines[n])["num_unfinished_reqs"])
        admission(engines[full], {"max_num_queued_reqs": 1})
        in_background(lambda: engines[full].post("/v1/completions", LONG_ANSWER))
        wait_until(lambda: admission(engines[full])["num_unfinished_reqs"] == 1, timeout=10,
                   what=f"the long answer on {full} to start")  # fmt: skip

        # The full engine's door refuses; the plugin retries once on the other main engine, which serves it.
        assert proxy.complete("hello")["choices"]
        assert (refused(engines[full]), refused(engines[roomy])) == (1, 0)
        assert scraped_sum(engines[roomy].url, "vllm:request_success_total") == 1
        assert door_retries(proxy) == {("main", "served"): 1}

        # Both main engines full: the retry is refused too, and the client gets the 503 with the door's
        # Retry-After. Nothing went to the interactive engine, which LiteLLM's fallback group also holds.
        admission(engines[roomy], {"max_num_queued_reqs": 1})
        body = json.dumps({"model": "deepseek-sim", "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(proxy.url + "/v1/completions", data=body,
                                         headers={"Authorization": f"Bearer {MASTER_KEY}",
                                                  "Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=30)
        assert answer.value.code == 503
        assert answer.value.headers.get("Retry-After") == "1"  # no prefill rate given: the door's least
        assert MESSAGES["max_num_queued_reqs"] in answer.value.read().decode()
        assert (refused(engines[full]), refused(engines[roomy])) == (2, 1)
        assert door_retries(proxy) == {("main", "served"): 1, ("main", "refused_again"): 1}
        assert scraped_sum(engines["fast"].url, "batchlens_door_requests_total") == 0
        log = proxy.process.log_path.read_text()
        assert f"the door of main engine {full} refused a request; retried on {roomy}, which served it" in log
    finally:  # the engines first, and at once: each would wait out its long answer, and the proxy the one it relays
        for engine in engines.values():
            engine.process.stop(signal.SIGKILL)
        proxy.stop()
