"""Masks that are patterns run as cuDNN's own masking: no bias read, fully masked tiles skipped.

Under ThunderFX, HF models materialize every mask (causal, sliding window, key padding, all-True).
The executor holds the mask's data at run time, so it checks exactly, over the whole tensor, for: all
kept (no mask; in an inference forward, padding keeping every key); torch's causal (the diagonal band,
right bound 0); causal with a window of W keys (left bound W); key padding (batch element b keeps
keys j < n_b: cuDNN's padding mask with ``seq_len_kv`` bound per call); causal with padding. A float
mask masks with -inf or anything <= its dtype's lowest finite value. Anything else stays an additive
bias. The verdict costs one host sync per distinct mask and state, kept in the converted-mask cache
(same identity and version rules); none is made or reused under CUDA-graph capture, with the mask
cache off, or for an inference tensor (no version counter). The pattern is in the graph key; the
lengths are bound per call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe import config
from thunder_cudnn_safe.masks.bias import capturing, converted_masks
from thunder_cudnn_safe.masks.documents import DocumentPattern, as_4d, document_checks, document_verdict, kept_runs
from thunder_cudnn_safe.telemetry import Counts


class MaskPattern(NamedTuple):
    """A mask as cuDNN's masking: ``right`` (0 = causal, None = none) and ``left`` (window) bounds of
    the top-left diagonal band; ``q_lens`` / ``kv_lens`` (B,1,1,1) int32 for the padding mask, or None."""

    right: int | None
    left: int | None
    q_lens: Any = None
    kv_lens: Any = None
    #: of an all-kept mask: (q_lens, kv_lens) keeping every key, to run it as padding
    #: (:func:`~thunder_cudnn_safe.plan.planner.with_mask_pattern`)
    full: Any = None

    @property
    def name(self) -> str:
        parts = {"causal": self.right == 0, "window": self.left is not None, "padding": self.kv_lens is not None}
        return "+".join(part for part, on in parts.items() if on) or "all_kept"


_NOT_A_PATTERN = "bias"
_counts = Counts()
mask_pattern_info, reset_mask_pattern_info = _counts.public(
    "mask_pattern_info", 'How many distinct masks were recognized as each pattern ("bias": none) since a reset.'
)


def patterns_on() -> bool:
    """Whether masks may run as patterns: ``config.mask_patterns``, and the mask cache (keeping verdicts) on."""
    return bool(config.mask_patterns) and converted_masks.maxsize > 0


def pattern_of(mask: torch.Tensor, batch: int, lq: int, s: int) -> MaskPattern | None:
    """``mask``'s pattern for a (batch, H, lq, s) call, or None (a bias): cached per distinct mask."""
    if not patterns_on() or capturing(mask) or mask.is_inference() or mask.requires_grad:
        return None
    verdict = converted_masks.get(mask, ("pattern", batch, lq, s), lambda: _recognize(mask, batch, lq, s), count=False)
    return None if verdict == _NOT_A_PATTERN else verdict


def _recognize(mask: torch.Tensor, batch: int, lq: int, s: int) -> MaskPattern | DocumentPattern | str:
    docs = document_checks(mask, batch, lq, s)  # packed sequences: block-diagonal document masks
    if docs is None:
        pattern = recognize(mask, batch, lq, s)
    else:  # both recognizers' checks in one host sync; documents only where no other pattern holds
        pattern, values = recognize(mask, batch, lq, s, extra=docs[0])
        if pattern is None:
            pattern = document_verdict(values, docs[1], batch, lq)
    _counts.count(_NOT_A_PATTERN if pattern is None else pattern.name)
    return _NOT_A_PATTERN if pattern is None else pattern


def recognize(mask: torch.Tensor, batch: int, lq: int, s: int, extra: torch.Tensor | None = None) -> Any:
    """The exact pattern of ``mask`` (broadcastable to (batch, H, lq, s)), or None; one host sync.

    ``extra`` (1-D int64 on the mask's device, for a mask of this shape) is synchronized in the same host
    sync: (pattern, its values) is then returned.
    """
    m = as_4d(mask, lq, s)
    if m is None:
        return None
    valid, count, lo, hi = kept_runs(m)
    n = hi.amax(dim=(1, 2), keepdim=True) + 1  # kept keys per batch element, if it pads
    row = torch.arange(lq, device=m.device)
    window = (row - lo + 1).amax()
    checks = torch.stack(
        [
            valid,
            ((hi - lo + 1 == count) & (count > 0)).all(),  # every row one non-empty run of keys
            (hi == s - 1).all(),
            (hi == row.clamp(max=s - 1)).all(),
            (hi == n - 1).all(),
            (hi == torch.minimum(row, n - 1)).all(),
            (lo == 0).all(),
            (lo == (row - window + 1).clamp(min=0)).all(),
        ]
    ).to(torch.int64)
    values = torch.cat([checks, window.view(1)] + ([] if extra is None else [extra])).tolist()
    pattern = _pattern_from(values[:9], n, m, batch, lq, s)
    return pattern if extra is None else (pattern, values[9:])


def _pattern_from(values: list[int], n: torch.Tensor, m: torch.Tensor, batch: int, lq: int, s: int) -> Any:
    valid, runs, full, causal, padded, causal_padded, no_left, windowed, window = values
    if not (valid and runs and (no_left or (windowed and lq <= s))):  # cuDNN 9.19 refuses a left bound with L > S
        return None
    if lq == 1:  # one query keeping key 0 only: padding, not a causal band (cudnn_rules.CAUSAL_DECODE_GQA)
        causal = causal_padded = 0
    left = None if no_left else int(window)
    lens = n.reshape(-1, 1, 1, 1).expand(batch, 1, 1, 1).to(torch.int32).contiguous()
    q_lens = torch.full((batch, 1, 1, 1), lq, dtype=torch.int32, device=m.device)
    if full and left is None:
        return MaskPattern(None, None, full=(q_lens, lens))
    if causal:
        return MaskPattern(0, left)
    if causal_padded:
        return MaskPattern(0, left, q_lens, lens)
    if padded and left is None:
        return MaskPattern(None, None, q_lens, lens)
    return None  # e.g. a window without the causal bound: not a form models produce
