"""One driver per analysis: the code that the report's stage, the ``mechgeom run`` verb and the
``mechgeom sweep`` verb of that analysis all call.

A driver runs the analysis' entry points on a model and its texts, takes their ``to_frame()`` tables and
``summary()`` numbers, draws the figures with :mod:`mechgeom.viz` and words the summary lines, and returns
one :class:`~mechgeom.report.base.StageOutput` whose tables and figures carry the driver's own names. It
computes no statistic itself. The report (:mod:`mechgeom.report.stages`,
:mod:`mechgeom.report.encoder_stages`) and the run verbs (:mod:`mechgeom.report.runs`) differ only in
their settings and in the file names they give the output (:meth:`StageOutput.renamed`).

Modules: :mod:`~.contributions`, :mod:`~.faithfulness` (ΔPPL, task accuracy and embedding curves),
:mod:`~.sinks` (decoder and encoder sinks), :mod:`~.selection` (token selection and the head taxonomy) and
:mod:`~.pruning` (single-head sweep and retention curves).
"""
