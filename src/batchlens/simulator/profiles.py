"""GPU and model profiles for the simulator: the numbers its step time is made of. Pure data.

Figures come from the vendors' data sheets (bandwidth, dense BF16 tensor
throughput, memory, board power) and from the models' published configs
(parameters, layers, KV heads). ``kv_bytes_per_token`` is
2 (K and V) x layers x KV heads x head dim x bytes per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_second: float  # peak DRAM bandwidth
    flops: float  # dense BF16 tensor throughput
    idle_watts: float
    max_watts: float
    #: Share of peak bandwidth a real decode kernel reaches; the rest is lost to access patterns.
    bandwidth_efficiency: float = 0.8


@dataclass(frozen=True)
class ModelProfile:
    name: str
    weight_bytes: float  # read once per step: every weight for a dense model, the active experts for a MoE
    kv_bytes_per_token: float
    flops_per_token: float  # ~2 x active parameters
    #: Per-step overhead outside the GPU's memory traffic: a + b*batch seconds (launches, scheduler, sampler).
    #: 3.5 ms puts batch-1 decode of a 7B BF16 model on an A100 at ~12 ms per token, as vLLM serves it; it is
    #: also why the bandwidth ratio is lowest at batch 1, where the fixed cost weighs most.
    overhead_seconds: tuple[float, float] = (0.0035, 0.00002)
    #: At batch B, attention reads each cached KV byte 1 + B/kv_reread_batch times: the paged-attention
    #: blocks of many sequences compete for L2, so reuse falls as the batch grows. This is what makes
    #: throughput gains shrink past batch 8 while bandwidth use climbs, as the article measured on
    #: DeepSeek-class models. A calibration, not a law: math.inf gives a pure roofline.
    kv_reread_batch: float = 8.0
    #: Mixture of experts under expert parallelism (DeepSeek-V3-class): the routed experts' bytes on this GPU,
    #: read only as far as the step's tokens route to them. ``weight_bytes`` is then what every step reads
    #: whole: attention, the shared expert, embeddings.
    expert_bytes: float = 0.0
    #: The share of the routed experts one token picks (top-k of all: 8/256 for DeepSeek-V3).
    expert_share: float = 0.0
    #: The ranks that run each step in lock step and route their tokens to this GPU's experts (the DP size with
    #: --enable-expert-parallel: the DP coordinator keeps every rank stepping, dummy batches on idle ones).
    #: The simulator runs one rank and takes the others to carry the same batch.
    lockstep_ranks: int = 1

    def weights_read(self, tokens: int) -> float:
        """The weight bytes one step of ``tokens`` scheduled tokens (on each rank) reads: everything dense, and
        each local expert that at least one of the step's tokens on any rank routes to."""
        if not self.expert_bytes or tokens <= 0:
            return self.weight_bytes if tokens > 0 else 0.0
        untouched = (1.0 - self.expert_share) ** (tokens * self.lockstep_ranks)
        return self.weight_bytes + self.expert_bytes * (1.0 - untouched)

    @property
    def resident_bytes(self) -> float:
        """The weights this GPU holds, read or not: what is left of its memory goes to the KV cache."""
        return self.weight_bytes + self.expert_bytes


# DeepSeek-V3/R1 (671B, 37B active, MLA, FP8 weights), from its published config (config.json, the V3 report):
# 61 layers, the first 3 dense; 58 MoE layers of 256 routed experts (top 8) and one shared, each expert three
# 7168x2048 matrices (44.0M parameters). Routed experts: 256 x 58 x 44.0M = 654B parameters, 1 byte each in
# FP8; the rest (MLA attention, the shared experts, the dense FFNs, embeddings and head) ~17B, every rank's.
# MLA caches one 512-wide latent and a 64-wide RoPE key per layer: (512 + 64) x 61 x 2 bytes (BF16) per token.
_DS_DENSE = 17 * GB
_DS_EXPERTS = 654 * GB
_DS_KV = (512 + 64) * 61 * 2
#: Prefill FLOPs per token at the BF16 rate the GPU profiles give: 2 x 37B in FP8 (twice that rate) plus MLA's
#: attention, at the MFU that puts H100/H200 prefill at ~6,000 computed tokens/s per GPU, between two published
#: figures: DeepSeek's production H800s at ~4,000 (73.7k input tokens/s per node, 56.3% of them prefix-cache
#: hits: "DeepSeek-V3/R1 Inference System Overview", github.com/deepseek-ai/open-infra-index, 2025-03-01) and
#: vLLM's H200 at a third to a fifth of its GB200's 26.2k ("Driving vLLM WideEP and Large-Scale Serving Toward
#: Maturity on Blackwell (Part I)", blog.vllm.ai, 2026-02). H800 computes as H100, and H200 as both.
_DS_FLOPS = 989e12 / 6000
#: Per step: 58 MoE layers x 2 all-to-alls (dispatch, combine) at ~25 us each, and launches; with CUDA graphs.
_DS_STEP = 0.004
#: Per token of the batch: the all-to-all's bytes (~10 MB a token: 58 layers x 7168 x (1 byte out + 2 back) x 8
#: experts) over NVLink (~450 GB/s) is ~22 us; the rest, MoE grouped GEMMs and MLA's absorbed attention far
#: from their rooflines, is calibrated so that DP8+EP decode on H200 gives ~2.2k output tokens/s per GPU at a
#: batch of 256 per rank and a 2k-token context: vLLM's published wide-EP figure ("vLLM Large Scale Serving:
#: DeepSeek @ 2.2k tok/s/H200 with Wide-EP", blog.vllm.ai, 2025-12-17), an upper bound for one node's DP8.
_DS_TOKEN = 0.000300


def _deepseek_v3(
    recipe: str, *, ranks: int, tp: int = 1, step: float = _DS_STEP, token_cost: float = _DS_TOKEN
) -> ModelProfile:
    """DeepSeek-V3 on 8 GPUs an engine (``ranks`` DP ranks of one GPU, or one engine of ``tp`` GPUs), seen from
    one GPU: the dense part split ``tp`` ways, the experts 8 GPUs' worth (or ``ranks``' where there are more),
    each rank's tokens reaching every GPU's experts in lock step."""
    return ModelProfile(
        f"deepseek-v3-{recipe}", _DS_DENSE / tp, _DS_KV, _DS_FLOPS / tp, (step, token_cost), kv_reread_batch=math.inf,
        expert_bytes=_DS_EXPERTS / max(8, ranks), expert_share=8 / 256, lockstep_ranks=ranks,
    )  # fmt: skip


GPUS: dict[str, GpuProfile] = {
    "a100-80g": GpuProfile("NVIDIA A100-SXM4-80GB", 80 * GB, 2.039e12, 312e12, 60, 400),
    "h100": GpuProfile("NVIDIA H100 80GB HBM3", 80 * GB, 3.35e12, 989e12, 70, 700),
    "h200": GpuProfile("NVIDIA H200", 141 * GB, 4.8e12, 989e12, 70, 700),
    "t4": GpuProfile("Tesla T4", 16 * GB, 320e9, 65e12, 10, 70),
    # Calibrated to a published vLLM measurement (PUBLISHED below): batch-1 decode of Llama-3.1-8B at 75
    # tokens/s is 77% of this card's bandwidth ceiling, with CUDA graphs leaving no per-step overhead to speak of.
    "a100-40g": GpuProfile("NVIDIA A100-SXM4-40GB", 40 * GB, 1.555e12, 312e12, 50, 400, bandwidth_efficiency=0.775),
}

MODELS: dict[str, ModelProfile] = {
    # Llama-2-7B-like: 32 layers, 32 KV heads x 128, BF16.
    "dense-7b": ModelProfile("dense-7b", 13.5 * GB, 2 * 32 * 32 * 128 * 2, 2 * 6.7e9),
    # DeepSeek-LLM-67B-like: 95 layers, 8 KV heads x 128 (GQA), FP8 weights to fit one 80 GB card.
    "dense-67b": ModelProfile("dense-67b", 67 * GB, 2 * 95 * 8 * 128 * 2, 2 * 67e9, (0.002, 0.0001)),
    # DeepSeek-V2-Lite-like MoE: 15.7B parameters, 2.4B active per token; MLA keeps the KV cache small.
    "moe-16b-a2.4b": ModelProfile("moe-16b-a2.4b", 2 * 2.4 * GB, 27 * 576 * 2, 2 * 2.4e9),
    # Llama-3.1-8B, BF16: 8.03B parameters, 32 layers, 8 KV heads x 128. A pure roofline (no KV re-read
    # penalty): throughput keeps rising with the batch until KV or the SLO binds, as PUBLISHED measured.
    "llama-3.1-8b": ModelProfile(
        "llama-3.1-8b", 16.06 * GB, 2 * 32 * 8 * 128 * 2, 2 * 8.03e9, (0.0, 0.00002), kv_reread_batch=math.inf
    ),
    # DeepSeek-V3, one rank of vLLM's high-load recipe on one 8xH200 node: --data-parallel-size 8
    # --enable-expert-parallel. Each GPU holds the dense part and 32 of the 256 experts; the 8 ranks step in
    # lock step and each one's tokens reach every GPU's experts. Does not fit an 80 GB card (99 GB of weights).
    "deepseek-v3-dp8ep": _deepseek_v3("dp8ep", ranks=8),
    # The two-node recipe on H100 (80 GB): --data-parallel-size 16 --data-parallel-size-local 8, a --headless
    # second node; 16 of the experts per GPU. Half of each all-to-all crosses the network, not NVLink.
    "deepseek-v3-dp16ep": _deepseek_v3("dp16ep", ranks=16, token_cost=_DS_TOKEN * 1.5),
    # vLLM's low-load recipe on 8xH200: --tensor-parallel-size 8 --enable-expert-parallel, one engine over 8
    # GPUs, seen from one of them: an eighth of the dense weights, 32 experts, the whole batch's KV (MLA's latent
    # cache cannot be split by head, so every TP rank holds it all). All-reduces, not all-to-alls: cheaper per
    # token (a quarter), but two per layer at ~25 us each (3 ms a step more), and the engine's whole batch on
    # every GPU.
    "deepseek-v3-tp8ep": _deepseek_v3("tp8ep", ranks=1, tp=8, step=_DS_STEP + 0.003, token_cost=_DS_TOKEN / 4),
}

#: The measurement the a100-40g + llama-3.1-8b pair is calibrated to: J. Musgrave, "vLLM throughput-latency
#: sweep on NVIDIA A100" (https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on): vLLM 0.23.0,
#: Llama-3.1-8B-Instruct BF16 on one A100 40GB, `vllm bench serve` with 1024-token prompts and 128-token
#: answers (ignore_eos) at a fixed concurrency. One request decodes at about 75 tokens/s; concurrency 8
#: gives 6.6x that; past 8, throughput keeps rising while per-token latency climbs.
PUBLISHED = {"concurrency_1_tokens_per_second": 75.0, "concurrency_8_speedup": 6.6, "prompt": 1024, "output": 128}

DEFAULT_GPU = "a100-80g"
DEFAULT_MODEL = "dense-7b"
