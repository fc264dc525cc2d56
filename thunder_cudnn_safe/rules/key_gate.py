"""The last gate before any graph is built: every rule that can be read off a graph key, checked on the key.

A rule must hold on every route (dense, mask pattern, packed sequences, a defect's workaround, the capture
prebuild, a dropout forward's check of its backward, another thread's copy) by construction, not because
each route remembers to check it. Every build passes through the graph cache
(:meth:`~thunder_cudnn_safe.graphs.cache.GraphCache.get_or_build`, the deviceless compile too), which asks
:func:`check` first, whatever the runtime's ``build`` does. A key
that breaks a rule on its own target is never built: the refusal is a definitive :class:`RuleRefusal`, so the
graph cache remembers it and the call takes its route's decline path (a packed-sequence call runs as a bias,
a dense call on the torch fallback, a dropout forward whose backward is refused falls back as a pair).

The trace-time checker (:mod:`support`) still declines what it can see; this gate catches what only the
planned key shows (a ragged backward's bucketed key length, a K/V broadcast declared with one head, a
prebuilt bias graph) and is the one place a new route cannot skip.
"""

from __future__ import annotations

from typing import Any

from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.rules.facts import of_key
from thunder_cudnn_safe.telemetry import Counts

_counts = Counts()


class RuleRefusal(GraphBuildError):
    """A key that breaks a known cuDNN rule on its target: never built. ``rule`` names the rule."""

    def __init__(self, rule: cudnn_rules.Rule, what: str) -> None:
        # what the trigger says (explain()'s text where the rule is read off calls too), with the rule's text
        super().__init__(
            f"{rule.name} (key gate): {what if rule.text in what else f'{what}: {rule.text}'}", definitive=True
        )
        self.rule = rule.name

    def holds(self, key: Any) -> bool:
        """Whether ``key`` still breaks the rule: DP_WORKSPACE reads ``config.dp_workspace_limit``, and a refusal
        remembered past a raised budget kept the backward on the fallback until ``clear_cache()``."""
        return any(rule.name == self.rule for rule, _ in violations(key))


def violations(key: Any) -> list[tuple[cudnn_rules.Rule, str]]:
    """Every rule ``key`` breaks on its own target, with what in the key breaks it (each rule's one trigger, read
    on the key's :class:`~thunder_cudnn_safe.rules.facts.Facts`). A key without a target (the compile sweep's,
    judged for several GPUs at once, or any other key the graph cache holds) has none to judge: no rule is read
    off it."""
    return [(rule, text) for rule, _, text in findings(key)]


def findings(key: Any) -> list[tuple[cudnn_rules.Rule, str, str]]:
    """:func:`violations` with each one's ``DeclineCode`` name: (rule, code, text), the first finding of each rule
    broken. ``explain()`` reports them for the keys a call plans
    (:func:`~thunder_cudnn_safe.rules.support.key_reasons`), so that a call it lets through is never refused here."""
    if getattr(key, "target", None) is None:
        return []
    facts = of_key(key)
    return [(rule, *found[0]) for rule in cudnn_rules.RULES if (found := rule.broken_by(facts))]


def check(key: Any) -> None:
    """Raise :class:`RuleRefusal` (counted) if ``key`` breaks a rule; a key that breaks none passes."""
    if found := violations(key):
        rule, what = found[0]
        _counts.count(rule.name)
        raise RuleRefusal(rule, what)


gate_info, reset_gate_info = _counts.public(
    "gate_info", "Keys the gate refused, by rule name (each distinct key once: the graph cache remembers the refusal)."
)
