"""The analyses: one package per idea of ``docs/definitions.md``, each with its maths, a Collector and a Result.

They import only the layers below them (:mod:`mechgeom.hooks`, :mod:`mechgeom.sweep`, :mod:`mechgeom.models`
and the shared helpers), never matplotlib, :mod:`mechgeom.viz` or the report.
"""
