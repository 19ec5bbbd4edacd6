"""The simulated engine: vLLM's continuous batching, in simulated time. Pure: no clock, no I/O.

Each :meth:`Engine.step` is one scheduler iteration, as in vLLM:

1. **Token budget.** Every running request in decode gets one token; requests
   still in prefill share what is left of ``max_num_batched_tokens`` (chunked
   prefill).
2. **Admission.** Then waiting requests enter the running batch, oldest first,
   while fewer than ``max_num_active_seqs`` run (batchlens' admission limit, at
   most ``max_num_seqs``), the step has tokens left for their prefill and the
   cache has room for their whole sequence.
3. **Paged KV cache.** A request holds ceil(tokens / block_size) blocks. When a
   block cannot be had, the newest running request is preempted: its blocks
   are freed and it returns to the head of the queue, to recompute its prompt
   and what it had generated (vLLM's recompute preemption).
4. **Step time.** A decode step is bound by memory bandwidth: it reads every
   weight once and every running request's KV cache (more than once at large
   batches, see profiles.py). A step heavy in prefill is bound by compute
   instead. A small overhead grows with the batch.

The caller owns time: it calls ``step(now)`` and gets back how long the step
took and what each request produced.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from batchlens.simulator.profiles import GpuProfile, ModelProfile


@dataclass
class SimRequest:
    id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    computed: int = 0  # tokens whose KV is in the cache (prompt, then generated)
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    admitted_at: float | None = None  # first admission: the end of its queue time
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    itl: list[float] = field(default_factory=list)  # gaps between output tokens, for the ITL histogram

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.tokens - (1 if self.generated else 0)


@dataclass(frozen=True)
class StepResult:
    started: float
    duration: float
    scheduled_tokens: int
    prefill_tokens: int
    decode_tokens: int
    bytes_read: float  # weights + KV read by this step
    produced: tuple[SimRequest, ...]  # requests that got a new output token this step
    finished: tuple[SimRequest, ...]
    preempted: int


class Engine:
    def __init__(
        self,
        gpu: GpuProfile,
        model: ModelProfile,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks: int | None = None,
    ):
        self.gpu, self.model = gpu, model
        self.max_num_seqs = max_num_seqs
        self.max_num_active_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        if num_gpu_blocks is None:
            kv_memory = gpu.memory_bytes * gpu_memory_utilization - model.resident_bytes
            num_gpu_blocks = int(kv_memory // (model.kv_bytes_per_token * block_size))
        if num_gpu_blocks < 1:
            raise ValueError(f"{model.name} does not fit on {gpu.name}: no memory left for the KV cache")
        self.num_gpu_blocks = num_gpu_blocks
        self.free_blocks = num_gpu_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.preemptions = 0

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.num_gpu_blocks

    @property
    def queued_tokens(self) -> int:
        """The prompt tokens of the requests still in prefill, counted whole, as vLLM's queued-token cap counts."""
        return sum(r.prompt_tokens for r in (*self.waiting, *self.running) if r.in_prefill)

    @property
    def awaiting_first_token(self) -> list[SimRequest]:
        """The requests with no first token yet, in the order the engine prefills them: what vLLM's API server sees
        as in prefill (the per-request door's second look judges them)."""
        return [r for r in (*self.running, *self.waiting) if r.first_token_at is None]

    @property
    def unfinished(self) -> int:
        """Requests waiting or running, as vLLM's queued-request cap counts them."""
        return len(self.waiting) + len(self.running)

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def abort(self, request: SimRequest, now: float) -> None:
        """Drop a request whose client went away; its blocks return to the cache."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return
        self._release(request)
        request.finished_at, request.finish_reason = now, "abort"

    def set_limit(self, limit: int) -> None:
        if not 1 <= limit <= self.max_num_seqs:
            raise ValueError(f"max_num_active_seqs must be in 1..{self.max_num_seqs}, got {limit}")
        self.max_num_active_seqs = limit

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _grow(self, request: SimRequest, tokens: int) -> bool:
        """Give ``request`` blocks for ``tokens`` cached tokens; False when the cache is full."""
        need = self._blocks_for(tokens) - request.blocks
        if need > self.free_blocks:
            return False
        self.free_blocks -= max(need, 0)
        request.blocks += max(need, 0)
        return True

    def _release(self, request: SimRequest) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0

    def _preempt_newest(self) -> SimRequest:
        victim = self.running.pop()
        self._release(victim)
        victim.computed = 0  # recompute: the KV is gone
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def step(self, now: float) -> StepResult:
        budget = self.max_num_batched_tokens
        plan: dict[str, tuple[SimRequest, int]] = {}
        preempted = 0
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted to make room for an older request
            want = min(request.tokens - request.computed, budget) if request.in_prefill else 1
            if want <= 0 or want > budget:
                continue
            while not self._grow(request, request.computed + want):
                victim = self._preempt_newest()
                preempted += 1
                if victim is request:
                    break  # not even this one fits now: it waits for space
                dropped = plan.pop(victim.id, None)
                if dropped is not None:
                    budget += dropped[1]
            else:
                plan[request.id] = (request, want)
                budget -= want
        self._admit(now, budget, plan)
        plan_items = list(plan.values())

        prefill = sum(n for r, n in plan_items if r.in_prefill)
        decode = sum(n for r, n in plan_items if not r.in_prefill)
        kv_read = self.kv_bytes_read(sum(r.computed for r, _ in plan_items), len(plan_items))
        weights = self.model.weights_read(prefill + decode)
        bytes_read = weights + kv_read if plan_items else 0.0
        duration = self.step_seconds(len(plan_items), prefill, kv_read, weights)

        end = now + duration
        produced, finished = [], []
        for request, n in plan_items:
            was_prefill = request.in_prefill
            request.computed += n
            if was_prefill and request.in_prefill:
                continue  # a chunk of a longer prompt: no token yet
            request.generated += 1
            if request.first_token_at is None:
                request.first_token_at = end
            else:
                request.itl.append(end - request.last_token_at)
            request.last_token_at = end
            produced.append(request)
            if request.generated >= request.max_tokens:
                request.finished_at, request.finish_reason = end, "length"
                self.running.remove(request)
                self._release(request)
                finished.append(request)
        return StepResult(
            now, duration, prefill + decode, prefill, decode, bytes_read, tuple(produced), tuple(finished), preempted
        )

    def _admit(self, now: float, budget: int, plan: dict[str, tuple[SimRequest, int]]) -> None:
        """Waiting requests into the batch, as vLLM's scheduler takes them: after the running ones, only while
        the step has tokens left to start their prefill. So a burst's prompts wait in the queue until prefill
        reaches them, and the waiting gauge shows a prefill backlog as vLLM's does, not only a batch at its limit
        (the door reads its drain rate from such windows). A request is let in only where the cache holds its
        whole sequence, not only its first chunk (vLLM 0.32's default ``scheduler_reserve_full_isl``): else a
        long prompt let in on a nearly full cache is preempted again. vLLM also lets none in during a step that
        preempted; here the one preempted heads the queue and does not fit, so none would be."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_active_seqs:
            request = self.waiting[0]
            want = min(request.tokens - request.computed, budget)
            whole = self._blocks_for(request.tokens) - request.blocks
            if whole > self.free_blocks or not self._grow(request, request.computed + want):
                return  # no room in the cache: it waits for a running request to finish
            self.waiting.popleft()
            if request.admitted_at is None:
                request.admitted_at = now
            self.running.append(request)
            plan[request.id] = (request, want)
            budget -= want

    def kv_bytes_read(self, cached_tokens: int, batch: int) -> float:
        """KV bytes attention reads in one step (see ModelProfile.kv_reread_batch)."""
        return cached_tokens * self.model.kv_bytes_per_token * (1 + batch / self.model.kv_reread_batch)

    def step_seconds(
        self, batch: int, prefill_tokens: int, kv_bytes: float, weight_bytes: float | None = None
    ) -> float:
        """Weights and KV over the achievable bandwidth, or prefill compute if longer, plus the overhead.
        ``weight_bytes``: what the step reads of the weights (a MoE's experts as far as its tokens reach)."""
        if batch == 0:
            return 0.0
        bandwidth = self.gpu.bandwidth_bytes_per_second * self.gpu.bandwidth_efficiency
        weights = self.model.weight_bytes if weight_bytes is None else weight_bytes
        memory = (weights + kv_bytes) / bandwidth
        compute = prefill_tokens * self.model.flops_per_token / self.gpu.flops
        a, b = self.model.overhead_seconds
        return max(memory, compute) + a + b * batch
