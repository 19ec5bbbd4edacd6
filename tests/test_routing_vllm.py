"""The routing plugin in the real LiteLLM proxy in front of a real vLLM 0.32 that schedules by priority.

Real: vLLM 0.32 on the CPU (`--scheduling-policy priority`, one sequence at a time, the batchlens plugin from
the built wheel, and a word tokenizer written by the harness), the LiteLLM proxy (1.106.12) with the config
batchlens generates and the plugin from the same wheel, and HTTP between them. Fake: the engine for long
prompts and the cold path is a batchlens simulator (a second real vLLM would not fit two cores beside the
first).

What this proves that the simulators cannot: LiteLLM forwards the `priority` the plugin puts in `extra_body`
to vLLM, and vLLM acts on it. With its only slot busy, a main request (priority 1) and then an interactive one
(priority 0) queue; vLLM serves the interactive one first although it came second. Without the priority (or
with LiteLLM dropping it) both are 0 and vLLM serves them in arrival order.
"""

from __future__ import annotations

import threading
import time

import pytest
import yaml

from batchlens.config import load_config
from batchlens.routing.proxy_config import litellm_config
from harness.exporter import parse_samples, pick, scraped_sum
from harness.litellm import LitellmProxy
from harness.procs import free_port
from harness.simulator import SimulatorProcess
from harness.vllm import MODEL_NAME, start_vllm

pytestmark = [pytest.mark.litellm, pytest.mark.vllm, pytest.mark.slow]
INTERACTIVE = {"x-batchlens-latency-class": "interactive"}
#: vLLM's max_tokens without an early stop: the dummy weights draw EOS now and then.
EXACT = {"extra_body": {"ignore_eos": True}}


def served(url: str) -> float:
    return scraped_sum(url, "vllm:request_success_total")


def tokens(n: int) -> str:
    """A text prompt of ``n`` tokens to every counter here (LiteLLM's completions route takes no token ids)."""
    return " the" * n


@pytest.fixture
def stack(tmp_path, vllm_plugin_env, litellm_env):
    vllm = start_vllm(tmp_path / "vllm", env=vllm_plugin_env, max_num_seqs=1, text=True,
                      extra_args=("--scheduling-policy", "priority"))  # fmt: skip
    other = SimulatorProcess(tmp_path, speed=20, args=("--served-model-name", MODEL_NAME))
    listed = [
        {"name": "vllm", "url": vllm.url, "role": ["main", "interactive"], "max_model_len": 2048,
         "scheduling_policy": "priority"},
        {"name": "sim", "url": other.url, "role": ["long", "cold"], "max_model_len": 8192},
    ]  # fmt: skip
    # No exporter answers: every engine's signals are unknown, so each role stands (falling back on signals
    # is test_routing_proxy's); the main and interactive requests below both queue on the one vLLM.
    routing = {"model": MODEL_NAME, "exporter_url": f"http://127.0.0.1:{free_port()}", "cold_gap": 3.0}
    path = tmp_path / "batchlens.yaml"
    path.write_text(yaml.safe_dump({"engines": listed, "routing": routing}))
    proxy = LitellmProxy(tmp_path, litellm_config(load_config(path, environ={})), path, litellm_env)
    try:
        yield vllm, other, proxy
    finally:
        proxy.stop()
        other.stop()
        vllm.process.stop()


def test_priority_reaches_vllm_through_litellm_and_each_class_its_engine(stack) -> None:
    vllm, other, proxy = stack
    ask = {"model": MODEL_NAME, **EXACT}
    # The first requests pay for vLLM's compilation and the proxy's clients; they also are the first arrival
    # (no gap yet: main) and one of each class.
    proxy.complete(tokens(16), max_tokens=8, **ask)
    proxy.complete(tokens(16), max_tokens=8, headers=INTERACTIVE, **ask)
    proxy.complete(tokens(3000), max_tokens=4, **ask)  # over 2048: the long engine
    assert (served(vllm.url), served(other.url)) == (2, 1)

    finished: dict[str, float] = {}
    errors: list[BaseException] = []

    def send(name: str, max_tokens: int, headers: dict[str, str] | None = None) -> None:
        try:
            proxy.complete(tokens(16), max_tokens=max_tokens, headers=headers, **ask)
            finished[name] = time.monotonic()
        except BaseException as exc:  # reported below
            errors.append(exc)

    # "busy" takes vLLM's only slot; then a main and an interactive request queue behind it, in that order.
    # Its 1800 tokens (of the 2048 the engine takes) run 2.3 s on an idle CI machine: 600 once ran out
    # before the interactive request was sent (0.8 s).
    threads = [threading.Thread(target=send, args=("busy", 1800))]
    threads.append(threading.Thread(target=send, args=("main", 64)))
    threads.append(threading.Thread(target=send, args=("interactive", 64, INTERACTIVE)))
    sent = {}
    for name, thread in zip(("busy", "main", "interactive"), threads, strict=True):
        thread.start()
        sent[name] = time.monotonic()
        time.sleep(0.4)
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    # The test holds only if both queued while "busy" ran.
    assert finished["busy"] > sent["interactive"], (sent, finished)
    assert finished["interactive"] < finished["main"], (
        "vLLM served the main request (priority 1) before the interactive one (priority 0): the priority did "
        f"not reach it. sent {sent}, finished {finished}"
    )

    time.sleep(3.5)
    proxy.complete(tokens(16), max_tokens=4, **ask)  # after a quiet spell: cold, which the simulator serves
    assert (served(vllm.url), served(other.url)) == (2 + 3, 1 + 1)
    found = pick(parse_samples(proxy.metrics()), "batchlens_routing_decisions_total")
    decisions = {(dict(k)["wanted"], dict(k)["role"]): v for k, v in found.items() if v}
    assert decisions == {("main", "main"): 3, ("interactive", "interactive"): 2, ("long", "long"): 1,
                         ("cold", "cold"): 1}  # fmt: skip
