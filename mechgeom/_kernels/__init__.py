"""Native kernels (private): C sources shipped in the package, built on first use, and their loaders.

:mod:`~mechgeom._kernels.build` compiles and loads a kernel; :mod:`~mechgeom._kernels.fused` is the fused
contribution sweep. They sit below the analyses and import none of them: an analysis hands them its tensors
through the protocol :class:`mechgeom._kernels.fused.LayerGeometry`.
"""
