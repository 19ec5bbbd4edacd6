"""Write vLLM's `vllm serve` arguments as JSON (dest -> flags and choices): the lint-config table.

Run it with vLLM's own Python, from the repository root:

    ~/.cache/batchlens/vllm-0.32.0/bin/python scripts/vllm_args.py > src/batchlens/lint/vllm_0_32_args.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from batchlens.lint import vllm_arguments

if __name__ == "__main__":
    json.dump(vllm_arguments(), sys.stdout, indent=1, sort_keys=True, default=str)
    sys.stdout.write("\n")
