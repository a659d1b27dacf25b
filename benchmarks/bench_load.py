"""Load time of an offline model with a cold and a warm cache, and peak RSS, each in a fresh process.

    python benchmarks/bench_load.py [--model smollm2-135m]

A cold load reads the GGUF through transformers and converts it with TransformerLens; a warm load reads
the processed state dict from the cache. Each measurement runs in its own subprocess so that peak RSS
(``ru_maxrss``) belongs to that load alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import mechgeom
t1 = time.perf_counter()
model = mechgeom.load_model(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(model: str, cache: str) -> dict[str, float]:
    env = {**os.environ, "MECHGEOM_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = measure(args.model, cache)
        warm = measure(args.model, cache)
    print(f"| {args.model} | load (s) | peak RSS (MB) |")
    print("|---|---|---|")
    print(f"| cold cache | {cold['load_s']:.1f} | {cold['peak_rss_mb']:.0f} |")
    print(f"| warm cache | {warm['load_s']:.1f} | {warm['peak_rss_mb']:.0f} |")
    print(f"(import mechgeom: {warm['import_s']:.1f} s)")


if __name__ == "__main__":
    main()
