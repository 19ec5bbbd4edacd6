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
}

#: The measurement the a100-40g + llama-3.1-8b pair is calibrated to: J. Musgrave, "vLLM throughput-latency
#: sweep on NVIDIA A100" (https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on): vLLM 0.23.0,
#: Llama-3.1-8B-Instruct BF16 on one A100 40GB, `vllm bench serve` with 1024-token prompts and 128-token
#: answers (ignore_eos) at a fixed concurrency. One request decodes at about 75 tokens/s; concurrency 8
#: gives 6.6x that; past 8, throughput keeps rising while per-token latency climbs.
PUBLISHED = {"concurrency_1_tokens_per_second": 75.0, "concurrency_8_speedup": 6.6, "prompt": 1024, "output": 128}

DEFAULT_GPU = "a100-80g"
DEFAULT_MODEL = "dense-7b"
