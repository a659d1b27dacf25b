"""Regenerate ``backend_reference.pt``: contribution metrics of the TransformerLens 3.x HookedTransformer.

On TransformerLens 4.x no hooked model can be built, so the bridge is checked against these stored numbers
(tests/integration/test_models_smollm2.py). Run with the 3.x venv:
``HF_HUB_OFFLINE=1 .venv/bin/python tests/data/make_backend_reference.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = "The capital of France is Paris, and the capital of Italy is Rome."
LAYERS = {"smollm2-135m": [0, 15, 29], "gemma-3-270m": [0, 9, 17]}
INTRA = ["attention", "value_weighted_normalized", "contribution", "head_share"]
INTER = ["attention", "value_weighted", "contribution"]


def build() -> dict[str, dict[str, object]]:
    import mechgeom
    from mechgeom.models import TL_VERSION

    out: dict[str, dict[str, object]] = {}
    for name, layers in LAYERS.items():
        model = mechgeom.load_model(name, backend="hooked")
        with torch.no_grad():
            res = mechgeom.contribution_weights(model, TEXT, layers=layers, intra=INTRA, inter=INTER)
        out[name] = {
            "text": TEXT,
            "layers": layers,
            "tokens": res.tokens,
            "intra": {k: v.clone() for k, v in res.intra.items()},
            "inter": {k: v.clone() for k, v in res.inter.items()},
            "transformer_lens": TL_VERSION,
        }
        del model
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("backend_reference.pt")
    torch.save(build(), path)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
