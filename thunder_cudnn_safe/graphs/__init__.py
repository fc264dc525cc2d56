"""Graphs: a cuDNN frontend graph built from a key and nothing else (:mod:`.build`), cuDNN's own verdict on
it without a GPU (:mod:`.lowering`), the process-wide cache of built graphs with its memory of refusals
(:mod:`.cache`, which asks the key gate before every build) and the opt-in persistent plan cache on disk
(:mod:`.plan_cache`).

May import :mod:`~thunder_cudnn_safe.layouts`' keys, :mod:`~thunder_cudnn_safe.rules`' key gate and the
plumbing; never a runtime or the dispatcher (a runtime builds through :mod:`.build`; this subpackage never
runs anything).
"""
