"""Every cuDNN architecture and version rule the package relies on, one named entry each.

These are the most safety-critical facts in the package: a rule claimed too widely sends cuDNN a graph it
cannot run (a crash, or a refusal and a slow fallback); a rule claimed too narrowly costs speed. Each
:class:`Rule` says what it allows or requires, where the fact comes from (a release note, a frontend check,
a GPU measurement), on which targets it holds and what triggers it: one trigger over the :class:`Facts` of a call
(``explain()``, the checker) or of a graph key (the key gate). The checker, the key gate, recipes, emulation and
the lowering sweep read the rules from here and nowhere else.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from thunder_cudnn_safe import config
from thunder_cudnn_safe._env import DP_WORKSPACE_LIMIT_ENV
from thunder_cudnn_safe.layouts.keys import Target
from thunder_cudnn_safe.layouts.layout import ALIGNMENT_BYTES, INT32_ELEMENT_LIMIT
from thunder_cudnn_safe.rules.facts import Facts

#: Where a rule's trigger is asked (:attr:`Rule.applies`): a defect or a limit where the rule holds (on the passes
#: it names), a capability where it does not, or anywhere (the trigger reads the target itself, where it needs one:
#: a call whose runtime cannot work here has none).
WHERE_IT_HOLDS, WHERE_IT_FAILS, ANYWHERE = "where it holds", "where it fails", "anywhere"


@dataclass(frozen=True)
class Rule:
    """One cuDNN fact (docs/design.md, "Adding a rule"): it holds where ``min_arch <= arch`` (the major
    ``arch_major``, or one in ``arch_majors``, where set) and ``min_backend <= cuDNN < max_backend`` (``fixed_in``
    where unset), except ``except_backends`` (a fixed release inside a bad window). ``trigger(rule, facts)`` says
    what in a call's or a key's :class:`Facts` breaks it (a text, a :class:`Finding`, a list of them, or None),
    asked as ``applies`` says; a call's text becomes a ``Decline`` with ``code`` (a ``DeclineCode`` name), a key's
    a refusal of the key gate. ``example``: a call the rule declines, which tests/test_defect_rules.py builds (the
    target ``arch`` and ``backend``; shapes ``b, h, hk, lq, s, d, dv``; ``mask`` "bool" or "grad"; the call's keywords;
    ``proxies``: thunder proxies, not tensors; ``dp_workspace_limit``); ``silent``: a defect of
    docs/known-cudnn-defects.md (wrong numbers or a crash, not an error), which the key gate must read off keys.
    """

    text: str
    source: str
    min_arch: tuple[int, int] = (0, 0)
    arch_major: int | None = None
    min_backend: int = 0
    max_backend: int | None = None
    arch_majors: tuple[int, ...] = ()
    except_backends: tuple[int, ...] = ()
    passes: tuple[str, ...] = ("forward", "backward")
    trigger: Trigger | None = None
    applies: str = WHERE_IT_HOLDS
    #: the sources the trigger is asked on: a call's head dims and arch are judged at trace time only
    judged_on: tuple[str, ...] = ("call", "key")
    #: rules whose decline of the same call ``explain()`` gives instead (one reason; the key gate lists every rule)
    yields_to: tuple[str, ...] = ()
    silent: bool = False
    example: dict[str, Any] | None = None
    #: the first cuDNN version without the defect, named in a decline (:attr:`upgrade_hint`); it ends the window
    fixed_in: int | None = None
    code: str = "ARCH"
    #: the variable the rule is bound to in this module, set as :data:`RULES` is collected
    name: str = field(default="", init=False)

    def holds(self, target: Target) -> bool:
        arch, version = tuple(target.arch), int(target.backend_version)
        return (
            arch >= self.min_arch
            and self.arch_major in (None, arch[0])
            and (not self.arch_majors or arch[0] in self.arch_majors)
            and self.min_backend <= version < (self.max_backend or self.fixed_in or math.inf)
            and version not in self.except_backends
        )

    def declines(self, target: Target, backward_follows: bool) -> bool:
        """Whether the rule holds for a call on ``target``; a backward-only fact (``passes``) only where a backward
        follows (a training forward, whose stats and dropout mask bind it to the same executor's backward)."""
        return self.holds(target) and (backward_follows or "forward" in self.passes)

    def asks(self, facts: Facts) -> bool:
        """Whether the trigger is asked of ``facts`` (``applies``, ``judged_on``, ``passes``)."""
        if self.trigger is None or ("call" if facts.backward is None else "key") not in self.judged_on:
            return False
        if self.applies == ANYWHERE:
            return True
        if facts.target is None:
            return False
        if self.applies == WHERE_IT_FAILS:
            return not self.holds(facts.target)
        return self.holds(facts.target) and facts.in_pass(self.passes)

    def broken_by(self, facts: Facts) -> list[tuple[str, str]]:
        """What in a call's or a key's ``facts`` breaks this rule, as (``DeclineCode`` name, text) pairs."""
        found = self.trigger(self, facts) if self.asks(facts) else None
        found = () if found is None else (found,) if isinstance(found, (str, Finding)) else found
        return [(f.code, f.text) if isinstance(f, Finding) else (self.code, f) for f in found]

    def stated(self, facts: Facts, what: str = "") -> str:
        """A decline naming the target, then ``what``, the rule's text and where a newer cuDNN fixes it."""
        return f"{_sm(facts.target)}, cuDNN {facts.target.backend_version}: {what}{self.text}.{self.upgrade_hint}"

    def defect(self, facts: Facts, what: str) -> str:
        """A silent defect's decline: :meth:`stated` with ``what`` meets it and the rule's name."""
        return self.stated(facts, f"{what}: {self.name}: ")

    @property
    def upgrade_hint(self) -> str:
        """Where a newer cuDNN fixes the defect: the version and how to get it (README, "A newer libcudnn")."""
        if self.fixed_in is None:
            return ""
        version = f"{self.fixed_in // 10000}.{self.fixed_in // 100 % 100}.{self.fixed_in % 100}"
        return (
            f" Fixed in cuDNN {version}: `pip install 'nvidia-cudnn-cu13>={version}'` beside torch "
            "(README, 'A newer libcudnn')."
        )


class Finding(NamedTuple):
    """A trigger's text with its own ``DeclineCode`` name, for a rule whose declines carry several."""

    code: str
    text: str


Trigger = Callable[[Rule, Facts], "str | Finding | Sequence[str | Finding] | None"]


def _if(condition: bool, text: str) -> str | None:
    return text if condition else None


def _sm(target: Target) -> str:
    return f"sm{target.arch[0]}{target.arch[1]}"


def _tail_unmasked(f: Facts) -> bool:
    """:data:`HOPPER_BACKWARD_KV_TAIL_NAN`'s shape (a ragged key's s_kv: the bucketed longest document)."""
    return f.kv_len % 128 == 64 and not (f.causal and not f.masked and f.q_len <= f.kv_len)


def _dp_over_budget(f: Facts) -> tuple[float, float] | None:
    """(need, budget) in GiB where the dP workspace (:data:`DP_WORKSPACE`) a backward materializes on the target
    is over the budget (config.dp_workspace_limit); sm100's deterministic engine materializes none."""
    if not (f.dbias or (f.deterministic and not DETERMINISTIC_BACKWARD_BLACKWELL.holds(f.target))):
        return None
    need, limit = dp_workspace_bytes(f.batch, f.heads, f.q_len, f.kv_len), config.dp_workspace_limit
    return (need / 2**30, limit / 2**30) if need > limit else None


def _dp_workspace(rule: Rule, f: Facts) -> str | None:
    over = _dp_over_budget(f)
    if over is None:
        return None
    return (
        f"{'the mask gradient (dBias)' if f.dbias else 'cudnn_safe_deterministic'} needs {over[0]:.1f} GiB "
        f"of cuDNN dP workspace, over the {over[1]:.1f} GiB budget ({DP_WORKSPACE_LIMIT_ENV})"
    )


def _head_dims(rule: Rule, f: Facts) -> list[str]:
    """The head-dim rules, judged together as cuDNN does (HEAD_DIM_128, HEAD_DIM_256_TRAINING_HOPPER,
    UNEQUAL_HEAD_DIMS, MLA_192_128_HOPPER): what in a call ``rule`` declines (its target known)."""
    target, dims = f.target, (("query/key", f.d_qk), ("value", f.d_v))
    if target is None:
        return []
    found = [(HEAD_DIM_128, f"{name} head dim {d} is not a multiple of 8") for name, d in dims if d % 8]
    if (f.d_qk, f.d_v) != (192, 128) or not mla_192_128(target):  # DeepSeek-style MLA heads pass
        limit = head_dim_limit(target)
        limit_rule = HEAD_DIM_256_TRAINING_HOPPER if limit > 128 else HEAD_DIM_128
        on = f"the limit for training on {_sm(target)} with cuDNN {target.backend_version}"
        found += [(limit_rule, f"{name} head dim {d} exceeds {limit}, {on}") for name, d in dims if d > limit]
        unequal = f"d_qk={f.d_qk} != d_v={f.d_v}"
        if f.d_qk != f.d_v and not found:
            if not UNEQUAL_HEAD_DIMS.holds(target):
                found.append((UNEQUAL_HEAD_DIMS, f"{unequal} needs Hopper (sm90) or newer"))
            elif max(f.d_qk, f.d_v) > 128:
                found.append((MLA_192_128_HOPPER, f"{unequal}: above 128 only d_qk=192, d_v=128 is supported"))
    return [text for r, text in found if r is rule]


def _grouped_kv_heads(rule: Rule, f: Facts) -> str | Finding | None:
    if not f.enable_gqa:  # a call's option (None on a key)
        return None
    hk, hv, h = f.kv_heads, f.v_heads, f.heads
    if hk != hv or hk == 0 or h % hk:
        return f"enable_gqa: key/value heads ({hk}, {hv}) must be equal and divide the query heads ({h})"
    if f.target is not None and not rule.holds(f.target):
        return Finding("ARCH", "grouped K/V heads need cuDNN flash attention (sm80+)")
    return None


def _int32_sizes(rule: Rule, f: Facts) -> list[str]:
    """A call's query/key/value/output or a dense key's declared tensor (a huge bias too) whose elements reach
    2**31 (cuDNN's int32 element offsets); a call's mask bound as a B*H*L*S bias: its gradient is computed,
    patterns are off, or the call is softcapped (its mask, and ``is_causal``, are always a bias there:
    :data:`SOFTCAP_NO_MASK_SUBGRAPH`), which the run path would send to the torch fallback."""
    found = [
        f"{name} has {n} elements; element offsets would overflow int32"
        for name, n in f.elements
        if n >= INT32_ELEMENT_LIMIT
    ]
    if f.batch * f.heads * f.q_len * f.kv_len < INT32_ELEMENT_LIMIT or f.backward is not None:
        return found
    if f.mask and (f.dbias or not f.mask_patterns or f.softcap):
        how = (
            "its gradient is computed, from it as a bias"
            if f.dbias
            else "it is bound as a bias (with softcap, cuDNN allows no other masking)"
            if f.softcap
            else "it is bound as a bias (mask patterns or the mask cache are off)"
        )
        found.append(f"the broadcast attention mask has more than 2**31 elements (int32 offsets), and {how}")
    elif f.causal and f.softcap:
        found.append(
            "is_causal with softcap is bound as a causal bias (cuDNN allows no other masking beside a score "
            "modifier) whose broadcast has more than 2**31 elements (int32 offsets)"
        )
    return found


def _decode_backward_nan(rule: Rule, f: Facts) -> str | None:
    """A call with a mask tensor (one without is routed to the padding mask, routing/defect_routes, except beside
    softcap's score modifier, which allows no padding mask: its backward key breaks the rule, and ``explain()`` reads
    it there, support.key_reasons); a key without the padding mask."""
    if f.ragged or f.q_len != 1 or not (f.mask or f.padded is False):
        return None
    return rule.defect(
        f,
        "a single query with a mask tensor, in training"
        if f.mask
        else "a single query without the padding mask, in a backward",
    )


def dropout_in_range(p: float) -> bool:
    """Whether ``dropout_p`` is in [0, 1) (NaN is not)."""
    return 0.0 <= p < 1.0


def _off_sixteenths(p: float) -> bool:
    return p * 16 != math.floor(p * 16)


#: The head-dim rules: judged together, as cuDNN does, at trace time (a key's head dims are its call's).
_HEAD_DIM = dict(trigger=_head_dims, applies=ANYWHERE, judged_on=("call",), code="HEAD_DIM")
FLASH_ATTENTION = Rule(
    "cuDNN fused flash attention (forward and backward) runs on Ampere (sm80) or newer",
    "cuDNN developer guide, 'Fused Flash Attention' support surface",
    min_arch=(8, 0),
    trigger=lambda rule, f: f"{_sm(f.target)}: cuDNN fused flash attention needs Ampere (sm80) or newer",
    applies=WHERE_IT_FAILS,
    judged_on=("call",),
    example=dict(arch=(7, 5), backend=92600),
)
HEAD_DIM_128 = Rule(
    "head dims up to 128, multiples of 8, for forward and backward",
    "cuDNN developer guide, 'Fused Flash Attention' (d <= 128 on sm80+)",
    min_arch=(8, 0),
    **_HEAD_DIM,
    example=dict(arch=(8, 0), backend=92600, d=60),
)
HEAD_DIM_256_TRAINING_HOPPER = Rule(
    "128 < head dim <= 256 for training (forward and backward) on Hopper",
    "cuDNN 9.5.0 release notes; other architectures only gained d > 128 for the forward (9.10)",
    arch_major=9,
    min_backend=90500,
    **_HEAD_DIM,
    example=dict(arch=(9, 0), backend=92600, d=264),
)
UNEQUAL_HEAD_DIMS = Rule(
    "d_qk != d_v (both <= 128) on Hopper or newer",
    "cuDNN developer guide, 'Fused Flash Attention' (different QK and V head dims need sm90+)",
    min_arch=(9, 0),
    **_HEAD_DIM,
    example=dict(arch=(8, 0), backend=92600, d=64, dv=128),
)
MLA_192_128_HOPPER = Rule(
    "d_qk=192, d_v=128 (DeepSeek-style MLA heads) on Hopper",
    "cuDNN 9.5.0 release notes; lightning-thunder PR #2771",
    arch_major=9,
    min_backend=90500,
    **_HEAD_DIM,
    example=dict(arch=(9, 0), backend=92600, d=256, dv=128),
)
MLA_192_128_BLACKWELL = Rule(
    "d_qk=192, d_v=128 (DeepSeek-style MLA heads) on datacenter Blackwell (sm100/sm103)",
    "cuDNN 9.11.0 release notes; lightning-thunder PR #2771; the lowering sweep: cuDNN 9.19's validate "
    "refuses the backward on sm120 ('hidden_dim should be less than or equal to 128')",
    arch_major=10,
    min_backend=91100,
)
GROUPED_KV_HEADS = Rule(
    "K and V may have H_kv heads where H_kv divides H_q (MQA/GQA), forward and backward; dK/dV come back "
    "with H_kv heads",
    "cuDNN developer guide, 'Fused Flash Attention' (h_k, h_v divide h_q); PyTorch's cuDNN attention uses it "
    "since 2025; accepted by cuDNN 9.19's validate at sm80-sm120 (the lowering sweep)",
    min_arch=(8, 0),
    trigger=_grouped_kv_heads,
    applies=ANYWHERE,
    code="SHAPE",
    example=dict(arch=(9, 0), backend=92600, hk=3, enable_gqa=True),
)
BACKWARD_SEQ_1 = Rule(
    "sdpa_backward refuses s_q = s_kv = 1 (the forward accepts it)",
    "nvidia-cudnn-frontend 1.32 _sdpa_validate.py ('s_q = s_kv = 1 is not supported') and cuDNN 9.19's C++ "
    "validate, on every arch (the lowering sweep)",
    passes=("backward",),
    trigger=lambda rule, f: _if(
        not f.ragged and f.q_len == 1 and f.kv_len == 1,
        "query and key length are both 1: cuDNN's backward refuses s_q = s_kv = 1 (with dropout, the "
        "forward's mask could then not be reproduced)",
    ),
    code="SHAPE",
    example=dict(arch=(9, 0), backend=92600, lq=1, s=1),
)
DETERMINISTIC_BACKWARD_BLACKWELL = Rule(
    "the deterministic backward refuses dBias and dropout on datacenter Blackwell (sm100/sm103)",
    "cuDNN 9.19 C++ validate: 'Deterministic algorithm is not supported on blackwell architecture when dbias, "
    "rng/dropout, alibi is enabled' (the lowering sweep; sm120 accepts)",
    arch_major=10,
    passes=("backward",),
    trigger=lambda rule, f: _if(
        bool(f.deterministic) and f.dbias_or_dropout,
        f"cudnn_safe_deterministic with {'dropout' if f.dropout > 0 else 'a mask gradient'}: "
        f"cuDNN's deterministic backward refuses dBias and dropout on {_sm(f.target)}",
    ),
    yields_to=("DETERMINISTIC_BACKWARD_BLACKWELL_BEFORE_9_18",),  # refused whatever it computes: that rule says so
    example=dict(arch=(10, 0), backend=91900, dropout_p=0.125, deterministic=True),
)
DETERMINISTIC_BACKWARD_BLACKWELL_BEFORE_9_18 = Rule(
    "the deterministic backward is refused on datacenter Blackwell (sm100/sm103) before cuDNN 9.18.0",
    "nvidia-cudnn-frontend 1.32 include/cudnn_frontend/node/scaled_dot_product_flash_attention.h, "
    "CompositeSDPABackwardNode pre-validation: is_deterministic_algorithm && prop_major == 10 && backend < 91800 "
    "-> GRAPH_NOT_SUPPORTED 'Deterministic algorithm is not supported on blackwell architecture with cudnn version "
    "below 9.18.0' (claimed, every call was refused at build time and ran on the fallback)",
    arch_major=10,
    passes=("backward",),
    trigger=lambda rule, f: _if(bool(f.deterministic), rule.stated(f, "cudnn_safe_deterministic: ")),
    fixed_in=91800,
    example=dict(arch=(10, 0), backend=91701, deterministic=True),
)
DETERMINISTIC_BIAS_BACKWARD_BLACKWELL = Rule(
    "the deterministic backward with a bias (any attn_mask, without its gradient too) does not compile on "
    "datacenter Blackwell (sm100/sm103)",
    "the compile sweep (tests/test_cudnn_compile.py): cuDNN 9.19's engine 5 fails in NVRTC for sm100 "
    "(INTERNAL_ERROR_COMPILATION_FAILED, 'identifier \"reg_s\" is undefined': a codegen defect); sm80/sm90 build it. "
    "cuDNN 9.27 builds it for sm100 (the compile sweep's second cuDNN, .ci/second_cudnn.sh); 9.20-9.26 are untested "
    "and stay declined",
    arch_major=10,
    # a forward key has no deterministic flag (None): its backward's key is refused
    trigger=lambda rule, f: _if(bool(f.deterministic) and f.masked and not f.dbias_or_dropout, rule.stated(f)),
    fixed_in=92700,
    example=dict(arch=(10, 0), backend=91900, mask="bool", deterministic=True),
)
DROPOUT_DBIAS_BLACKWELL = Rule(
    "dropout with a mask gradient (dBias) has no backward engine on datacenter Blackwell (sm100/sm103)",
    "the compile sweep (tests/test_cudnn_compile.py): cuDNN 9.19's engines 1, 4, 7 refuse it for sm100 ('With dropout, "
    "this engine only supports fprop inference under non matching device version and architecture'), no other "
    "engine serves dBias; sm80/sm90 build it. Deviceless planning: a B200 run may lift it",
    arch_major=10,
    passes=("backward",),
    trigger=lambda rule, f: _if(f.dropout > 0 and bool(f.dbias), rule.stated(f)),
    example=dict(arch=(10, 0), backend=91900, mask="grad", dropout_p=0.125),
)
#: One defect of two code paths (sm80's and sm120's), a rule each.
_SQ_VECTORS = dict(
    text="a backward with an attn_mask when the key length is 1 has no engine: its bias (..., L, 1) is a third "
    "'sq broadcasted vector' and these code paths take 2",
    source="the compile sweep (tests/test_cudnn_compile.py), cuDNN 9.19: 'Only 2 sq broadcasted vectors are supported "
    "on SM80' (its SM80 and SM120 code paths; an sm120 descriptor confirms it); sm90/sm100 build it",
    # a call is declined whole (its forward is not shown to have an engine), a key in its backward only
    trigger=lambda rule, f: _if(f.masked and f.kv_len == 1 and f.backward is not False, rule.stated(f)),
)
BIAS_KEY_LENGTH_1_AMPERE = Rule(arch_major=8, example=dict(arch=(8, 0), backend=92600, s=1, mask="bool"), **_SQ_VECTORS)
BIAS_KEY_LENGTH_1_SM120 = Rule(
    arch_major=12, example=dict(arch=(12, 0), backend=92600, s=1, mask="bool"), **_SQ_VECTORS
)
DBIAS_KEY_LENGTH_1_BLACKWELL = Rule(
    "a mask gradient (dBias) when the key length is 1 has no backward engine on datacenter Blackwell (sm100/sm103)",
    "the compile sweep, cuDNN 9.19: no engine config for sm100 ('This tile size is not supported for Blackwell "
    "flash bprop'); sm90 builds it",
    arch_major=10,
    passes=("backward",),
    trigger=lambda rule, f: _if(bool(f.dbias) and f.kv_len == 1, rule.stated(f)),
    example=dict(arch=(10, 0), backend=91900, s=1, mask="grad"),
)
DYNAMIC_SHAPE_FORWARD = Rule(
    "an SDPA forward (not the backward) builds as a dynamic-shape graph whose kernel a kernel cache reuses "
    "for new shapes",
    "cudnn-frontend 1.18.0 release notes (cuDNN 9.18.1: dynamic shapes for SDPA fprop); the compile sweep: sm80, sm90, "
    "sm100 plan every variant (causal, bias, padding, stats) and compile once for 64 lengths. cuDNN 9.27 refuses "
    "every dynamic-shape SDPA graph ('This engine currently does not support dynamic shape' from each native SDPA "
    "runtime-fusion engine, the compile sweep's second cuDNN); 9.20-9.26 are untested: a refused dynamic graph is "
    "built static (runtime.build_with_ladder), so trying costs one refusal per topology",
    min_arch=(8, 0),
    min_backend=91801,
    max_backend=92700,
)
DO_OWN_STRIDES = Rule(
    "sdpa_backward reads dO through its own declared strides (before 9.5.1 it assumed O's strides)",
    "cuDNN 9.5.1 release notes; PyTorch's cuDNN attention warned about dO/O stride mismatch until then",
    min_backend=90501,
    trigger=lambda rule, f: _if(f.do_as_o is False, "a backward key declares dO strides other than O's"),
    applies=WHERE_IT_FAILS,
    silent=True,
    judged_on=("key",),
)
STATS_PACKED_ONLY = Rule(
    "a non-ragged Stats input of sdpa_backward must be packed BHSD (exact strides, size-1 dims too)",
    "nvidia-cudnn-frontend 1.32 sdpa_support_surface.h (checked before planning)",
    trigger=lambda rule, f: _if(
        f.stats_packed is False, "a backward key declares stats with other than packed BHSD strides"
    ),
    silent=True,
    fixed_in=92600,
    judged_on=("key",),
)

#: Layout rules every target shares (:data:`~thunder_cudnn_safe.layouts.layout.ALIGNMENT_BYTES`,
#: :data:`~thunder_cudnn_safe.layouts.layout.INT32_ELEMENT_LIMIT`): :mod:`~thunder_cudnn_safe.layouts.layout`
#: enforces them, the emulated runtime refuses their violation.
LAYOUT = Rule(
    f"inner stride 1, {ALIGNMENT_BYTES}-byte aligned base, other strides multiples of {ALIGNMENT_BYTES} bytes, "
    f"non-overlapping positive strides, element offsets below 2**31",
    "cuDNN developer guide (tensor descriptors for SDPA; TMA alignment on Hopper)",
    trigger=_int32_sizes,
    applies=ANYWHERE,
    silent=True,
    code="INT32",
    example=dict(arch=(9, 0), backend=92600, h=1, lq=2**25, proxies=True),
)


def head_dim_limit(target: Target) -> int:
    """Largest head dim cuDNN supports for forward *and* backward on ``target``."""
    return 256 if HEAD_DIM_256_TRAINING_HOPPER.holds(target) else 128


def mla_192_128(target: Target) -> bool:
    """Whether d_qk=192, d_v=128 is supported on ``target``."""
    return MLA_192_128_HOPPER.holds(target) or MLA_192_128_BLACKWELL.holds(target)


DP_WORKSPACE = Rule(
    "a backward with dBias, or deterministic (except on sm100's deterministic engine), materializes dP "
    "in a workspace of B*H_q*pad64(S_q)*pad64(S_kv)*2 bytes: 8.6 GB at B=8, H=32, S=4096",
    "cudnn_frontend 1.32 node/scaled_dot_product_flash_attention.h, CompositeSDPABackwardNode: "
    "use_dp_workspace is forced for dBias and is_deterministic_algorithm; required_dp_workspace_bytes",
    passes=("backward",),
    trigger=_dp_workspace,
    silent=True,
    code="WORKSPACE",
    example=dict(arch=(9, 0), backend=92600, deterministic=True, dp_workspace_limit=1),
)


def dp_workspace_bytes(batch: int, heads_q: int, s_q: int, s_kv: int) -> int:
    """The dP workspace of :data:`DP_WORKSPACE` (the frontend's own formula)."""
    return batch * heads_q * (-(-s_q // 64) * 64) * (-(-s_kv // 64) * 64) * 2


# -- packed sequences (variable-length / ragged attention, :mod:`~thunder_cudnn_safe.routing.varlen`) ----------
VARLEN_BACKEND = Rule(
    "packed sequences run as variable-length attention (padding mask + ragged offsets) from cuDNN 9.19.0: "
    "the version whose graphs were validated, planned and NVRTC-compiled for sm80/sm90/sm100",
    "shared/notes/packed-sequences.md (libcudnn 9.19.0, frontend 1.32); THD below sm90 needs >= 9.18.1, "
    "ragged + GQA backward >= 9.6 (cudnn-frontend scaled_dot_product_flash_attention.h)",
    min_arch=(8, 0),
    min_backend=91900,
    trigger=lambda rule, f: _if(f.ragged, "a variable-length (ragged) graph"),
    applies=WHERE_IT_FAILS,
    judged_on=("key",),
)
VARLEN_BACKWARD_ARCH = Rule(
    "a variable-length backward reads ragged (tokens-major) stats, which sm80 and sm12x refuse ('Packed/ragged "
    "LSE is not supported for bprop thd on SM8X and SM12X GPUs'; deterministic is refused there too): packed "
    "sequences that need a backward run as variable-length attention on sm90 and sm100 only (sm80's dense-stats "
    "backward ignores max_total_seq_len, its workspace grows with N*S: 3.2 GB for a Llama-8B step)",
    "libcudnn 9.19 validate at sm80 (shared/notes/packed-sequences.md, fact 4)",
    min_arch=(9, 0),
    trigger=lambda rule, f: _if(f.ragged and f.training, "ragged (tokens-major) stats"),
    applies=WHERE_IT_FAILS,
    judged_on=("key",),
)
VARLEN_BACKWARD_SM12X = Rule(
    "sm12x refuses a ragged-stats variable-length backward, like sm80",
    "cudnn-frontend 1.32 rule string 'bprop thd on SM8X and SM12X GPUs'",
    arch_major=12,
    trigger=lambda rule, f: _if(f.ragged and f.training, "ragged (tokens-major) stats"),
    judged_on=("key",),
)
VARLEN_NO_DROPOUT = Rule(
    "packed sequences with dropout run as a bias: the variable-length dropout mask's numbering per document "
    "is not verified against the emulated reference",
    "this package (no GPU measurement of ragged dropout)",
    min_backend=10**9,
    trigger=lambda rule, f: _if(f.ragged and bool(f.dropout), "a ragged graph with dropout"),
    applies=WHERE_IT_FAILS,
    judged_on=("key",),
)
VARLEN_BATCH_STRIDE = Rule(
    "a ragged tensor's declared batch stride is never stepped but must be a multiple of 16 bytes (PyTorch's "
    "INT_MAX is refused): the package declares S_bucket x token stride, S_bucket a power of two >= 16",
    "libcudnn 9.19 validate, 'stride 2147483647 of dimension 0 ... not a multiple of the tensor's 16-byte alignment'",
    trigger=lambda rule, f: (
        None if f.ragged_batch_stride is None else "{}'s declared batch stride {}".format(*f.ragged_batch_stride)
    ),
    judged_on=("key",),
)

#: The frontend's opt-in switch for its own Python (CuTe-DSL) engines; the frontend reads it at every planning.
FRONTEND_OWN_ENGINES_ENV = "CUDNN_FRONTEND_ENABLE_FROST_ENGINES"


def _frontend_own_backward(target: Target) -> bool:
    """Whether the frontend may serve a ragged backward with its own kernels: frontend 1.32 offers its sm100 d128 and
    d256 backward rows (THD, window) only with :data:`FRONTEND_OWN_ENGINES_ENV` set (cudnn/engines/manifest.py,
    ``opt_in=True``); another frontend's offering is unread."""
    enabled = os.environ.get(FRONTEND_OWN_ENGINES_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
    return enabled or not str(target.frontend_version).startswith("1.32.")


VARLEN_WINDOW_BACKWARD_FRONTEND_BLACKWELL = Rule(
    "the frontend's own (Python, CuTe-DSL) variable-length backward with a sliding window gives NaN dQ on "
    "datacenter Blackwell (sm100/sm103); a packed windowed backward is declined there (it runs as a bias) wherever "
    "the frontend may serve it with its own kernels: with CUDNN_FRONTEND_ENABLE_FROST_ENGINES set, or a frontend "
    "other than 1.32 (libcudnn's engines serve it otherwise; fix version not stated)",
    "NVIDIA/cudnn-frontend#536 (closed 2026-08-10; SM100, cuDNN 9.25.1, cutlass-dsl 4.6: THD + sliding window "
    "backward, NaN in most of dQ)",
    arch_major=10,
    trigger=lambda rule, f: _if(
        bool(f.backward) and f.ragged and f.window is not None and _frontend_own_backward(f.target),
        "a variable-length backward with a window the frontend may serve with its own kernels",
    ),
    silent=True,
    judged_on=("key",),
)

RAGGED_STATS_DECODE_GQA = Rule(
    "a forward writing ragged (THD) stats with a single query (s_q == 1) and grouped K/V heads (H_q > H_kv) writes "
    "the logsumexp only for the first query head of each K/V group (the decode-class kernel packs a group's query "
    "heads); the other heads' stats keep whatever the buffer held, and the backward reads them. O is right; padded "
    "stats, MHA and s_q >= 2 are right. Seen on sm80, sm90 and sm100 with 9.26.0 and 9.27.0 (the report), 9.24 "
    "(a flashinfer review) and a 9.28 build (cudnn-frontend CI): no fixed version is known, so it holds on every "
    "version. A ragged key declares its longest document bucketed (>= 16 tokens), so the packed route's keys never "
    "meet it; a packed training step whose every document is one token, with grouped heads, is declined too "
    "(routing/varlen.decline: it runs as a bias)",
    "NVIDIA/cudnn-frontend#1083 (open; NVBug 6783545: 'Stats (LSE) is written only for the first q head of every kv "
    "group ... cuDNN 9.26.0.51 and 9.27.0.21 ... SM80, SM90 and SM100'); flashinfer PR #5245 (keeps single-token "
    "GQA ragged steps off cuDNN); cudnn-frontend PR #1082 (CI at cuDNN 92800: the ragged GQA decode Stats cases "
    "still fail)",
    trigger=lambda rule, f: _if(
        f.ragged and f.backward is False and f.training and f.q_len == 1 and f.heads != f.kv_heads,
        rule.defect(f, f"ragged stats of a single query with {f.heads} query and {f.kv_heads} key/value heads"),
    ),
    silent=True,
    judged_on=("key",),
)


# -- attention beyond F.sdpa: the sink token and the score modifier (shared/notes/attention-variants.md) ----
SINK_TOKEN = Rule(
    "attention sinks run as cuDNN's sink token ((1, H, 1, 1) float32, and dSink_token in the backward) from "
    "cuDNN 9.13; older libraries refuse the node",
    "cudnn-frontend 1.32 C++ node (scaled_dot_product_flash_attention.h: sink_token needs cuDNN >= 9.13); "
    "libcudnn 9.19 validates and builds forward and backward with a sink token at sm80, sm90, sm100 (lowering sweep)",
    min_arch=(8, 0),
    min_backend=91300,
    trigger=lambda rule, f: _if(bool(f.sinks), rule.stated(f, "attention sinks: ")),
    applies=WHERE_IT_FAILS,
    example=dict(arch=(9, 0), backend=91200, sinks=True),
)
SINK_DECODE = Rule(
    "cuDNN's backend engines refuse a sink token with a single query (s_q == 1, 'decode only mode ... not "
    "supported with sink_token')",
    "cudnn-frontend 1.32 sdpa_support_surface.h (kept by its _sdpa_validate.py docstring for the backend engines)",
    trigger=lambda rule, f: _if(
        bool(f.sinks) and f.q_len == 1, rule.stated(f, "attention sinks with a single query: ")
    ),
    example=dict(arch=(9, 0), backend=92600, lq=1, s=64, sinks=True),
)
SINK_RAGGED = Rule(
    "a sink token with packed (THD, ragged) sequences needs cuDNN 9.26: older libraries read out of bounds in the "
    "backward's dO * O pre-pass (cudnn-frontend refuses that backward below 9.26; TransformerEngine gates sinks "
    "with THD there); from 9.26 libcudnn builds forward and backward on sm90 and sm100. The package still runs "
    "documents with sinks as a bias (the planner: the variable-length binder declares no sink token)",
    "cudnn-frontend 1.32 scaled_dot_product_flash_attention.h ('SDPA backward with ragged offsets and a sink token "
    "requires cuDNN 9.26.0 or newer'); TransformerEngine#3249 / #3470 (shared/notes/cudnn-defects.md, addendum of "
    "2026-12-06); the compile sweep, tests/test_cudnn_compile.py::test_ragged_sink_graphs_compile_from_9_26 "
    "(libcudnn 9.27: sm90 and sm100 build forward and backward; 9.19 builds the forward only)",
    min_backend=92600,
    trigger=lambda rule, f: _if(f.ragged and bool(f.sinks), "a ragged graph with sinks"),
    applies=WHERE_IT_FAILS,
    judged_on=("key",),
)
SINK_DETERMINISTIC = Rule(
    "cuDNN computes dSink_token non-deterministically even with use_deterministic_algorithm=True: the frontend "
    "declares it as an ADD reduction over batch and queries of exp(sink - stats) * rowsum(dO * O) in the backward's "
    "dO * O pre-pass, which the deterministic flag does not order (it only forces the dP workspace, or sm90's "
    "ordered dQ). A deterministic backward with sinks (cudnn_safe_deterministic, torch.use_deterministic_algorithms) "
    "is declined on every arch and version (no fixed version known): thunder runs the decomposition, whose torch "
    "reductions are reproducible; the inference forward stays claimed",
    "cudnn-frontend test/python/sdpa/fp16.py, check_deterministic ('NOTE: dSink_token is implemented "
    "non-deterministically (even if determinism enabled), therefore not included in this check'); cudnn-frontend "
    "1.32 include/cudnn_frontend/node/scaled_dot_product_flash_attention.h, CompositeSDPABackwardNode "
    "('reduce_per_token_grad': ReductionMode_t::ADD into DSINK_TOKEN; is_deterministic_algorithm only sets "
    "use_dp_workspace / use_sm90_ordered_dq_deterministic)",
    passes=("backward",),
    trigger=lambda rule, f: _if(
        bool(f.deterministic) and bool(f.sinks), rule.stated(f, "a deterministic backward with attention sinks: ")
    ),
    example=dict(arch=(9, 0), backend=92600, sinks=True, deterministic=True),
)
SOFTCAP_NO_MASK_SUBGRAPH = Rule(
    "a score modifier (softcapping) turns off every other masking subgraph: no causal band, window, padding mask "
    "or ALiBi beside it, a bias only; the planner runs a softcapped call's padding and documents as a bias, its "
    "band (is_causal, a causal, window or bottom-right mask) inside the modifier (SOFTCAP_BAND_IN_MODIFIER) or, "
    "where that rule fails, as a bias",
    "cudnn-frontend 1.32 _sdpa_validate.py ('Attention score mod enabled and hence other subgraphs are disabled')",
    trigger=lambda rule, f: _if(
        bool(f.softcap) and (bool(f.padded) or f.ragged), "a score modifier beside a padding mask or ragged offsets"
    ),
    # a call's is_causal and mask are planned as a bias or a band in the modifier beside a softcap: only its key shows
    judged_on=("key",),
)
SOFTCAP_BAND_IN_MODIFIER = Rule(
    "a softcapped call's band (causal, sliding window, bottom-right) is declared inside the score modifier "
    "(GEN_INDEX, CMP_GE / CMP_GT, BINARY_SELECT after the cap: graphs.build._band_mask) from cuDNN 9.19, where "
    "libcudnn 9.19 and 9.27 build its forward (sm80, sm90, sm100) and backward (sm90, sm100; sm80's is "
    "SOFTCAP_BACKWARD's); older versions are not swept, and there the planner runs the band as a bias instead",
    "the compile sweep, tests/test_cudnn_compile.py::test_softcap_band_graphs_compile (libcudnn 9.19 and 9.27, "
    "frontend 1.32, A100/H100/B200 descriptors); docs/deviceless.md, 'Softcap with causal and window masks' (a "
    "window as LOGICAL_AND of two comparisons, or its reach added in float, gets no engine on any arch)",
    min_arch=(8, 0),
    min_backend=91900,
    trigger=lambda rule, f: _if(
        bool(f.softcap) and (f.causal or f.window is not None),
        rule.stated(f, "a band inside a score modifier: "),
    ),
    applies=WHERE_IT_FAILS,
    judged_on=("key",),
)


SOFTCAP_BACKWARD = Rule(
    "libcudnn has an engine for an SDPA backward with a score modifier (softcap's score_mod_bprop, declared as "
    "cudnn-frontend's Softcap: MUL, TANH_BWD, DIV) on Hopper (sm90) and datacenter Blackwell (sm10x) only, from "
    "cuDNN 9.19: none on sm80 ('No valid engine configs'; its forward builds), and sm8x, sm12x and older versions "
    "are not swept. Elsewhere a softcapped training call is declined and runs the decomposition, its inference "
    "forward is claimed. Rerun the compile sweep's variant test with a newer cuDNN before widening the window",
    "the compile sweep, tests/test_cudnn_compile.py::test_attention_variant_graphs_compile (libcudnn 9.19 and 9.27, "
    "frontend 1.32, A100/H100/B200 descriptors: backward engine 6 on sm90, 5 on sm100, none on sm80); "
    "docs/deviceless.md, 'Softcap backward' (a backward written dS * (1 - t * t) gets no engine on any arch)",
    arch_majors=(9, 10),
    min_backend=91900,
    passes=("backward",),
    trigger=lambda rule, f: _if(bool(f.softcap) and f.in_pass(rule.passes), rule.stated(f, "softcap in training: ")),
    applies=WHERE_IT_FAILS,
    example=dict(arch=(8, 0), backend=92600, softcap=30.0),
)


def varlen_backward_holds(target: Target) -> bool:
    """Whether a variable-length backward (ragged stats) is accepted on ``target``."""
    return VARLEN_BACKWARD_ARCH.holds(target) and not VARLEN_BACKWARD_SM12X.holds(target)


# -- cuDNN defects that give wrong numbers without an error (docs/known-cudnn-defects.md) -------------
# Each is decided at trace time from shapes, arch and version. Where the real trigger also depends on
# the data (a very negative logsumexp), the rule guards the whole shape-level condition.
BLACKWELL_DECODE = Rule(
    "cuDNN 9.19.0-9.25.0 (except 9.24.1) computes a wrong output for a single query (s_q == 1, decode) on "
    "SM 10.x/11.x, forward and backward; the trigger also needs very negative scores (Qwen2.5-like data), "
    "which trace time cannot see, so every s_q == 1 call is declined",
    "pytorch/pytorch#193893 (open, 'module: correctness (silent)'), PR #194927: 'cuDNN SDPA decode is disabled "
    "for cuDNN versions 9.19-9.25.0 (except 9.24.1) on SM 10.x and 11.x' (MHA.cpp, forward and backward)",
    arch_majors=(10, 11),
    min_backend=91900,
    except_backends=(92401,),
    trigger=lambda rule, f: _if(not f.ragged and f.q_len == 1, rule.defect(f, "a single query (decode)")),
    silent=True,
    fixed_in=92501,
    example=dict(arch=(10, 0), backend=91900, lq=1, s=64),
)
HOPPER_BACKWARD_KV_TAIL_NAN = Rule(
    "the sm90 flash backward (kernel sm90_flash_bprop_wgmma_f16_knob_26) leaves the padded half of the last "
    "128-key tile unmasked when s_kv % 128 == 64: dQ is NaN for a query row whose logsumexp is below -88.7 "
    "(e.g. a row masked with a finite minimum). The logsumexp is data, so every backward with s_kv % 128 == 64 "
    "is declined unless torch's causal band masks the tail (is_causal, no mask tensor, s_q <= s_kv: causal is "
    "clean in the report; with s_q > s_kv the band no longer covers the tail). The padding-mask workaround is "
    "not verified for this defect. First bad version unknown (seen on 9.19 and 9.20), fixed in 9.26.0",
    "pytorch/pytorch#196678 (regression since torch 2.11), PR #196861; NVIDIA/cudnn-frontend#628 (nvbug 6591137)",
    arch_major=9,
    passes=("backward",),
    trigger=lambda rule, f: _if(_tail_unmasked(f), rule.defect(f, f"key length {f.kv_len} (% 128 == 64), in training")),
    silent=True,
    fixed_in=92600,
    example=dict(arch=(9, 0), backend=91900, s=64),
)
HOPPER_DECODE_BACKWARD_NAN = Rule(
    "the sm90 backward with a single query (s_q == 1) gives NaN dK/dV when the logsumexp is very negative "
    "(data: guarded for every s_q == 1 backward). The reporter's control, the padding mask at full lengths, is "
    "clean: the backward (and its forward, so the pair matches) is built with it; a call with a mask tensor "
    "(which runs as a bias, or as a pattern known only at run time) is declined. Seen on 9.25.1 and 9.26.0, "
    "open; no earlier version was tested and the same Hopper flash backward serves them, so the route applies "
    "on every version (the padded graph is one the package builds for padding masks anyway) below 9.26, where "
    "HOPPER_DECODE_BACKWARD_CRASH declines the call",
    "NVIDIA/cudnn-frontend#1072 (open): 'Enabling the padding mask with actual sequence lengths equal to the "
    "full tensor lengths avoids the NaNs'",
    arch_major=9,
    passes=("backward",),
    # without a mask tensor a call's backward is routed to the padding mask at full lengths (defect_routes)
    trigger=_decode_backward_nan,
    silent=True,
    example=dict(arch=(9, 0), backend=92600, lq=1, s=16, mask="bool"),
)
HOPPER_DECODE_BACKWARD_CRASH = Rule(
    "cuDNN 9.26 kills the process (a segfault in create_execution_plans) planning the sm90 backward of a single "
    "query (reported at B = H = 1, s_kv = 128, d = 64, bf16, not causal); whether HOPPER_DECODE_BACKWARD_NAN's "
    "padded graph avoids it is unknown, and a crash cannot fall back, so every sm90 backward with s_q == 1 is "
    "declined from 9.26.0 on (no fixed version known)",
    "NVIDIA/cudnn-frontend#1071 (open, H200, cuDNN 9.26.0.51, frontend 1.26); frontend 1.32 guards no backward "
    "graph from the backend's planner (cudnn/engines/manifest.py: backend_guard is the SDPA forward's only)",
    arch_major=9,
    min_backend=92600,
    passes=("backward",),
    trigger=lambda rule, f: _if(not f.ragged and f.q_len == 1, rule.stated(f, "a single query, in training: ")),
    silent=True,
    example=dict(arch=(9, 0), backend=92600, lq=1, s=16),
)
CAUSAL_DECODE_GQA = Rule(
    "a causal decode forward (s_q == 1, is_causal) with H_q != H_kv gives a wrong result; no fixed version is "
    "known, so it holds on every version",
    "cuDNN 9.18.1 release notes, Known Issues ('Decode-phase scaled dot-product attention should usually be run "
    "without causal masking ... if the layer has Q head count != K/V head count, the result ...')",
    trigger=lambda rule, f: _if(
        not f.ragged and f.q_len == 1 and f.causal and f.kv_heads != f.heads,
        rule.defect(f, f"causal decode with {f.heads} query and {f.kv_heads} key/value heads"),
    ),
    silent=True,
    example=dict(arch=(8, 0), backend=92600, hk=2, lq=1, s=64, is_causal=True, enable_gqa=True),
)
BACKWARD_KEY_LENGTH_1 = Rule(
    "the backward is not supported with key/value length 1 (s_kv == 1, any s_q, with or without a mask); the "
    "frontend refuses only s_q = s_kv = 1, so the rest builds: declined, as PyTorch does",
    "cuDNN 9.18.1 release notes, Known Issues ('bprop is not supported when both key/value have sequence length "
    "of 1'); PyTorch sdp_utils.cpp check_cudnn_tensor_shapes ('does not support key/value sequence length 1')",
    passes=("backward",),
    trigger=lambda rule, f: _if(not f.ragged and f.kv_len == 1, rule.defect(f, "key length 1, in training")),
    silent=True,
    example=dict(arch=(9, 0), backend=92600, s=1),
)
DROPOUT_SIXTEENTHS = Rule(
    "some cuDNN SDPA kernels round dropout_p to a multiple of 1/16 silently: other values are declined",
    "PyTorch sdp_utils.cpp check_cudnn_dropout, PR #174245 ('cuDNN dropout probability resolution is limited to 1/16')",
    trigger=lambda rule, f: _if(
        dropout_in_range(f.dropout) and _off_sixteenths(f.dropout),
        f"dropout_p={f.dropout} is not a multiple of 1/16: {rule.text}",
    ),
    applies=ANYWHERE,
    silent=True,
    code="DROPOUT",
    example=dict(arch=(9, 0), backend=92600, dropout_p=0.1),
)
GRID_65535 = Rule(
    "batch size or head count above 65535 fails at execute (a grid dimension): declined at trace time",
    "PyTorch PR #181235, PR #180718 and sdp_utils.cpp check_cudnn_tensor_shapes ('cuDNN SDPA does not support "
    "batch size or num_heads greater than 65535')",
    trigger=lambda rule, f: _if(
        max(f.batch, f.heads, f.kv_heads) > GRID_LIMIT,
        f"batch {f.batch}, heads {f.heads}/{f.kv_heads}: {rule.text}",
    ),
    applies=ANYWHERE,
    silent=True,
    code="SHAPE",
    example=dict(arch=(9, 0), backend=92600, b=65536, h=1, proxies=True),
)
#: The largest batch size and head count :data:`GRID_65535` allows.
GRID_LIMIT = 65535


def _named(name: str, rule: Rule) -> Rule:
    object.__setattr__(rule, "name", name)  # (frozen: named once, here)
    return rule


#: Every rule in definition order, each named after its variable; the key gate and ``explain()`` read this table.
RULES: tuple[Rule, ...] = tuple(_named(name, v) for name, v in dict(globals()).items() if isinstance(v, Rule))
