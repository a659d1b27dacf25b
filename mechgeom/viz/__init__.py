"""Presentation: circuitsvis views (:mod:`mechgeom.viz.views`) and matplotlib figures
(:mod:`mechgeom.viz.figures`, :mod:`mechgeom.viz.selection_figures`), and static PNGs of the views
(:mod:`mechgeom.viz.static`, headless Chromium). Every function draws a result; none
computes an analysis or switches the matplotlib backend.
"""

from mechgeom.viz.figures import *  # noqa: F403
from mechgeom.viz.figures import __all__ as _figures
from mechgeom.viz.selection_figures import *  # noqa: F403
from mechgeom.viz.selection_figures import __all__ as _selection_figures
from mechgeom.viz.static import *  # noqa: F403
from mechgeom.viz.static import __all__ as _static
from mechgeom.viz.views import *  # noqa: F403
from mechgeom.viz.views import __all__ as _views

__all__ = sorted({*_views, *_static, *_figures, *_selection_figures})
