"""Dispatch: the per-call loop both executors share (:mod:`.dispatcher`: plan -> bind -> cached graph ->
runtime -> fallback if refused), with its routes that span two operator calls: packed sequences
(:mod:`.packed`), dropout's forward/backward pairing (:mod:`.dropout`), the CUDA-graph capture prebuild
(:mod:`.capture`), and the context-parallel ring whose blocks are its calls (:mod:`.ring`).

May import every subpackage below it (runtimes, graphs, routing, rules, layouts, masks) and the plumbing; never
thunder, nor its registration (:mod:`~thunder_cudnn_safe.integration`), which calls it.
"""
