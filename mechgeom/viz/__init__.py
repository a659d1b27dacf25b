"""Presentation: circuitsvis views (:mod:`mechgeom.viz.views`) and matplotlib figures
(:mod:`mechgeom.viz.figures`). Every function draws a result; none computes an analysis or switches the
matplotlib backend.
"""

from mechgeom.viz.figures import (
    plot_cone_shift,
    plot_convexity_curves,
    plot_curves,
    plot_rate_vs_ratio,
    plot_regime_grid,
    plot_retention,
    plot_sink_rate_vs_s_star,
    save_png,
)
from mechgeom.viz.views import (
    NEGATIVE_COLOR,
    POSITIVE_COLOR,
    View,
    head_view,
    layer_view,
    save_html,
    token_view,
)

__all__ = [
    "NEGATIVE_COLOR",
    "POSITIVE_COLOR",
    "View",
    "head_view",
    "layer_view",
    "plot_cone_shift",
    "plot_convexity_curves",
    "plot_curves",
    "plot_rate_vs_ratio",
    "plot_regime_grid",
    "plot_retention",
    "plot_sink_rate_vs_s_star",
    "save_html",
    "save_png",
    "token_view",
]
