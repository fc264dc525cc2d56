"""Rules: every cuDNN architecture, version and defect rule as one entry of a table
(:mod:`.cudnn_rules`: where it holds, what triggers it on a call or on a graph key, its action), read by
``explain()`` (:mod:`.support`), by the planner's workarounds (:mod:`.defect_routes`) and by the last gate
before any build (:mod:`.key_gate`), so a new route cannot skip a rule.

May import :mod:`~thunder_cudnn_safe.plan`'s values (keys, calls, layouts), :mod:`~thunder_cudnn_safe.masks`
and the plumbing; never a graph, a runtime or the dispatcher.
"""
