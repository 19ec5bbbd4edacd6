"""The real LiteLLM proxy (make litellm-env) with the batchlens routing plugin, as a subprocess.

The batchlens it loads is the wheel this session built, pip-installed into a folder on PYTHONPATH (over
the copy `make litellm-env` put in the environment), so the plugin is tested as users install it.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from batchlens.demo import LITELLM_ENV as DEFAULT_VENV  # make litellm-env's, where the demo finds it too
from batchlens.routing.proxy_config import LITELLM_VERSION, SERVER_ARGS
from harness.procs import Process, free_port

MASTER_KEY = "sk-batchlens-test-master-key-0123456789"
#: LiteLLM fetches its model cost map from GitHub at start; offline, it retries for seconds, then uses its copy.
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def litellm_venv() -> Path:
    venv = Path(os.environ.get("BATCHLENS_LITELLM_VENV", DEFAULT_VENV))
    if not (venv / "bin" / "litellm").exists() or not (venv / ".batchlens-ok").exists():
        pytest.fail(
            f"the LiteLLM environment {venv} is missing or incomplete. Create it with `make litellm-env` "
            f"(litellm[proxy]=={LITELLM_VERSION} and batchlens into {venv}; about 400 MB, once)."
        )
    return venv


def install_batchlens(wheel: Path, target: Path) -> dict[str, str]:
    """``pip install`` the built wheel (no dependencies: the environment has them) into ``target``."""
    pip = [str(litellm_venv() / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--target"]
    result = subprocess.run([*pip, str(target), str(wheel)], capture_output=True, text=True, cwd=target.parent)
    if result.returncode != 0:
        pytest.fail(f"pip install of {wheel.name} into the LiteLLM environment failed:\n{result.stderr[-3000:]}")
    return {"PYTHONPATH": str(target)}


class LitellmProxy:
    def __init__(self, workdir: Path, proxy_config: dict, batchlens_config: Path, env: dict[str, str],
                 port: int | None = None):  # fmt: skip
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "litellm.yaml"
        config.write_text(yaml.safe_dump(proxy_config, sort_keys=False))
        if "custom_auth" in proxy_config.get("general_settings", {}):  # LiteLLM imports it from the config's folder
            (workdir / "litellm_keys.py").write_text((Path(__file__).parent / "litellm_keys.py").read_text())
        argv = [str(litellm_venv() / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
                "--port", str(self.port), *SERVER_ARGS]  # fmt: skip
        env = {**env, **OFFLINE, "LITELLM_MASTER_KEY": MASTER_KEY, "BATCHLENS_CONFIG": str(batchlens_config)}
        self.process = Process("litellm", argv, workdir / f"litellm-{self.port}.log", env=env, cwd=workdir)
        self.process.wait_http(self.url + "/health/liveliness", timeout=120)

    def complete(self, prompt: str, *, headers: dict[str, str] | None = None, max_tokens: int = 4,
                 key: str = MASTER_KEY, **extra) -> dict:  # fmt: skip
        """One completion through the proxy; the parsed answer (AssertionError with LiteLLM's message if refused)."""
        body = json.dumps({"model": extra.pop("model", "deepseek-sim"), "prompt": prompt, "max_tokens": max_tokens,
                           **extra}).encode()  # fmt: skip
        request = urllib.request.Request(
            self.url + "/v1/completions", data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"the proxy refused: HTTP {exc.code}: {exc.read()[:500]!r}") from None

    def metrics(self) -> str:
        """LiteLLM's /metrics/ (its Prometheus callback's, with the plugin's counters): it asks for the key."""
        request = urllib.request.Request(self.url + "/metrics/", headers={"Authorization": f"Bearer {MASTER_KEY}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.read().decode()

    def stop(self) -> int:
        return self.process.stop()
