"""The vLLM source: one engine's /metrics and, where present, its admin API.

Each failure mode of an upstream maps to one bounded ``reason``:
``connect``, ``timeout``, ``http_<code>``, ``too_large``, ``protocol`` and
``parse`` make the engine down; ``admin_*`` reasons are counted but leave it up,
because the admin API is optional (absent, 404, is not an error at all).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from functools import partial

from pydantic import ValidationError

from batchlens.admin_api import BATCH_PATH, BatchState, missing_plugin
from batchlens.admin_auth import SIGNED_401_HINT, UNAVAILABLE_HINT, admin_headers
from batchlens.config import Engine
from batchlens.exporter.derive import batch_metrics, engines_seen, kv_block_metrics
from batchlens.exporter.http_get import HttpGetter
from batchlens.exporter.parser import ExpositionReader, Family, ParseError
from batchlens.exporter.render import family_blocks
from batchlens.exporter.sampler import SourceError
from batchlens.exporter.snapshot import Reading
from batchlens.masking import mask_url

log = logging.getLogger("batchlens.exporter")

_ADMIN_MAX_BYTES = 64 * 1024
# Ask for the classic text format: OpenMetrics would change counter and _created naming.
_ACCEPT = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1"}


class VllmSource:
    kind = "vllm"

    def __init__(
        self,
        engine: Engine,
        http: HttpGetter,
        executor: Executor | None = None,
        *,
        timeout: float,
        max_response_bytes: int,
        environ: Mapping[str, str],
    ):
        self.engine = engine
        self.labels = (*engine.series_labels.items(), *sorted(engine.labels.items()))
        self._base = dict(self.labels)
        self._http = http
        self._executor = executor
        self._timeout = timeout
        self._limit = max_response_bytes
        self._token = engine.admin_token(environ)
        self._reader = ExpositionReader(self._base)
        #: The model this server serves, as its metrics name it; the NVML source labels the engine's GPUs with it.
        self.model_name = ""
        self._admin_answers: set[bool] = set()  # whether the admin API answered (True) or 404 (False), ever

    async def sample(self) -> Reading:
        started = time.monotonic()
        url = self.engine.url + "/metrics"
        metrics, admin = await asyncio.gather(
            self._http.text(url, timeout=self._timeout, limit=self._limit, headers=_ACCEPT),
            self._admin_state(),
        )
        fetched = time.monotonic()
        # Parsing a large exposition takes milliseconds; keep it off the event loop
        # so that /metrics stays fast.
        loop = asyncio.get_running_loop()
        reading = await loop.run_in_executor(self._executor, self._digest, metrics, admin)
        log.debug(
            "vllm[%s]: fetched %d chars in %.3fs, digested in %.3fs",
            self.engine.name, len(metrics), fetched - started, time.monotonic() - fetched,
        )  # fmt: skip
        return reading

    def _admin_answered(self, ok: bool, url: str) -> None:
        """Say once why the batch panels show vLLM's own series alone (404); and once that the same server answers
        on some connections and not on others: one API server process of several runs without the plugin."""
        before = set(self._admin_answers)
        self._admin_answers.add(ok)
        if self._admin_answers == before:
            return
        if self._admin_answers == {False}:
            log.warning("vllm[%s]: %s answered 404: %s", self.engine.name, mask_url(url), missing_plugin(None))
        elif len(self._admin_answers) == 2:
            log.warning(
                "vllm[%s]: %s answered on some connections and 404 on others: one of the server's API server "
                "processes runs without the batchlens plugin (VLLM_PLUGINS=batchlens must reach every one)",
                self.engine.name, mask_url(url),
            )  # fmt: skip

    def _digest(self, text: str, admin: BatchState | tuple[str, str] | None) -> Reading:
        try:
            families: list[Family] = self._reader.parse(text)
        except ParseError as exc:
            raise SourceError(
                "parse", f"{mask_url(self.engine.url)}/metrics is not a Prometheus text exposition: {exc}"
            ) from None
        metrics = kv_block_metrics(families, self._base)
        self.model_name = next((model for model, _ in engines_seen(families) if model), self.model_name)
        soft: tuple[tuple[str, str], ...] = ()
        if isinstance(admin, BatchState):
            metrics += batch_metrics(admin, families, self._base)
        elif admin is not None:
            soft = (admin,)
        return Reading(blocks=family_blocks(families), metrics=tuple(metrics), soft_errors=soft)

    async def _admin_state(self) -> BatchState | tuple[str, str] | None:
        """The batch state, None where the server has no admin API, or a soft error."""
        url = self.engine.admin_url + BATCH_PATH
        try:
            signed = self.engine.admin_auth == "signed"
            # made for each attempt: a signature is taken once, and a GET on a stale connection goes again
            headers = partial(admin_headers, self._token, "GET", BATCH_PATH, signed=signed, pod=self.engine.pod)
            body = await self._http.text(url, timeout=self._timeout, limit=_ADMIN_MAX_BYTES, headers=headers)
            state = BatchState.model_validate_json(body)
            self._admin_answered(True, url)
            return state
        except SourceError as exc:
            if exc.reason == "http_404":  # a vLLM without the batchlens plugin: vLLM's own series only
                self._admin_answered(False, url)
                return None
            hint = ""
            if exc.reason in ("http_401", "http_403"):
                source = self.engine.admin_token_source
                hint = f" (does {source} hold the server's BATCHLENS_ADMIN_TOKEN? {SIGNED_401_HINT})"
            elif exc.reason == "http_503":
                hint = f" ({UNAVAILABLE_HINT})"
            return (f"admin_{exc.reason}", f"admin API: {exc}{hint}")
        except ValidationError as exc:
            return ("admin_invalid", f"admin API {mask_url(url)} answered an unexpected body: {exc.errors()[0]['msg']}")
