"""Rules: every cuDNN architecture, version and defect rule as one entry of a table
(:mod:`.cudnn_rules`: where it holds, what triggers it on a call or on a graph key, its action), read by
``explain()`` (:mod:`.support`, on plain facts: the integration reads thunder's proxies), by the plans (the
planner's workarounds, the recipes) and by the last gate before any build (:mod:`.key_gate`, which the graph
cache asks), so a new route cannot skip a rule.

May import :mod:`~thunder_cudnn_safe.layouts` (keys, alignment, int32 limits, layout arithmetic),
:mod:`~thunder_cudnn_safe.masks` and the plumbing; never a plan, a graph, a runtime, the dispatcher or thunder.
"""
