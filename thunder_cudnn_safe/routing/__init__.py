"""Plan: what a call is and how it runs. A call is one value (:mod:`.calls`), a recipe turns it into a graph
key (:mod:`~thunder_cudnn_safe.layouts.keys`) and its variant pack (:mod:`.recipes`; :mod:`.varlen` for packed
sequences), a known defect's documented workaround rewrites the call (:mod:`.defect_routes`), and
:mod:`.planner` decides the route of every call, in one place, for the run path, ``describe()``, ``aot`` and
the CUDA-graph capture prebuild.

May import :mod:`~thunder_cudnn_safe.rules` (the planner applies them), :mod:`~thunder_cudnn_safe.layouts`,
:mod:`~thunder_cudnn_safe.masks` and the plumbing; nothing below imports it. Nothing here builds or runs a
graph.
"""
