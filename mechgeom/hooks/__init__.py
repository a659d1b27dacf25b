"""The hooks layer: readers that stream ``hook_pattern``/``hook_v``/``hook_z`` into collectors
(:mod:`mechgeom.hooks.readers`), the input validators (:mod:`mechgeom.hooks.validation`), every intervention factory (:mod:`mechgeom.hooks.interventions`), and the
position sets they share (:mod:`mechgeom.hooks.masks`). Nothing here imports an analysis.

>>> from mechgeom.hooks import hook_name
>>> hook_name(3, "pattern")
'blocks.3.attn.hook_pattern'
"""

from mechgeom.hooks.interventions import *  # noqa: F403
from mechgeom.hooks.interventions import __all__ as _interventions
from mechgeom.hooks.masks import *  # noqa: F403
from mechgeom.hooks.masks import __all__ as _masks
from mechgeom.hooks.readers import *  # noqa: F403
from mechgeom.hooks.readers import __all__ as _readers
from mechgeom.hooks.validation import *  # noqa: F403
from mechgeom.hooks.validation import __all__ as _validation

__all__ = sorted({*_readers, *_validation, *_masks, *_interventions})
