"""Plan: what a call is and how it runs. A call is one value (:mod:`.calls`), a graph is described by a
hashable key (:mod:`.keys`) whose layouts are read off the tensors bound to it (:mod:`.layout`, the
``Uid`` of every bound tensor), a recipe turns a call into a key and its variant pack (:mod:`.recipes`;
:mod:`.varlen` for packed sequences), and :mod:`.planner` decides the route of every call, in one place,
for the run path, ``describe()``, ``aot`` and the CUDA-graph capture prebuild.

May import :mod:`~thunder_cudnn_safe.masks`, the plumbing, and :mod:`~thunder_cudnn_safe.rules`, which in
turn reads this subpackage's values (keys, calls, layouts): the planner applies the rules, the rules read
the planned values, so the two are one layer. Nothing here builds or runs a graph.
"""
