"""Masks that are patterns run as cuDNN's own masking: no bias read, fully masked tiles skipped.

Under ThunderFX, HF models materialize every mask (causal, sliding window, key padding, all-True).
The executor holds the mask's data at run time, so it checks exactly, over the whole tensor, for: all
kept (no mask; in an inference forward, padding keeping every key); torch's causal (the diagonal band,
right bound 0); causal with a window of W keys (left bound W); key padding (batch element b keeps
keys j < n_b: cuDNN's padding mask with ``seq_len_kv`` bound per call); causal with padding; for L < S,
causal aligned bottom-right (the queries are the last L positions: prefill against a KV cache, chunked
prefill), with or without a window, with or without padding. A float
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
    the diagonal band (top-left unless ``bottom_right``); ``q_lens`` / ``kv_lens`` (B,1,1,1) int32 for the
    padding mask, or None."""

    right: int | None
    left: int | None
    q_lens: Any = None
    kv_lens: Any = None
    #: of an all-kept mask: (q_lens, kv_lens) keeping every key, to run it as padding
    #: (:func:`~thunder_cudnn_safe.routing.planner.with_mask_pattern`)
    all_kept_lens: Any = None
    #: the band aligned bottom-right (L < S): the L queries are the last L of the S keys' positions (with the
    #: padding mask, of each batch element's n_b), as in prefill against a KV cache or chunked prefill
    bottom_right: bool = False
    #: with ``kv_lens``: its smallest length as a host int (read in the verdict's one host sync), or None where
    #: unknown. cuDNN's padding mask leaves the dK/dV rows of keys past seq_len_kv unwritten; every such row of
    #: every batch element lies at or past this one, so a backward zeroes only those rows (None: all of them).
    #: Like the length tensors it is this mask's, bound per call: a pattern's signature drops it.
    min_kv_len: int | None = None

    @property
    def name(self) -> str:
        parts = {
            "causal": self.right == 0,
            "bottom_right": self.bottom_right,
            "window": self.left is not None,
            "padding": self.kv_lens is not None,
        }
        return "+".join(part for part, on in parts.items() if on) or "all_kept"


_NOT_A_PATTERN = "bias"
_counts = Counts()
mask_pattern_info, reset_mask_pattern_info = _counts.public(
    "mask_pattern_info", 'How many distinct masks were recognized as each pattern ("bias": none) since a reset.'
)


def patterns_on() -> bool:
    """Whether masks may run as patterns: ``config.mask_patterns``, and the mask cache (keeping verdicts) on."""
    return bool(config.mask_patterns) and converted_masks.maxsize > 0


#: :func:`known_pattern`'s answer for a mask whose verdict is not cached: only :func:`pattern_of` can tell.
UNKNOWN = "unknown"


def pattern_of(mask: torch.Tensor, batch: int, lq: int, s: int) -> MaskPattern | None:
    """``mask``'s pattern for a (batch, H, lq, s) call, or None (a bias): cached per distinct mask."""
    if not _may_be_pattern(mask):
        return None
    verdict = converted_masks.get(mask, ("pattern", batch, lq, s), lambda: _recognize(mask, batch, lq, s), count=False)
    return None if verdict == _NOT_A_PATTERN else verdict


def known_pattern(mask: torch.Tensor, batch: int, lq: int, s: int) -> MaskPattern | DocumentPattern | str | None:
    """What :func:`pattern_of` answers for ``mask`` now, without reading the mask: its cached verdict (a pattern,
    or None: a bias), None where no mask may be a pattern, or :data:`UNKNOWN` (a mask not seen in this state: a
    new one, or one written in place since). A dispatch memo hit reuses the verdict this way, so a mask's route
    follows its values with one cache lookup and no planning."""
    if not _may_be_pattern(mask):
        return None
    verdict = converted_masks.lookup(mask, ("pattern", batch, lq, s), UNKNOWN)
    return None if verdict == _NOT_A_PATTERN else verdict


def _may_be_pattern(mask: torch.Tensor) -> bool:
    """Whether :func:`pattern_of` reads ``mask`` at all: not with patterns off, under CUDA-graph capture (a verdict
    is a host decision replays would not re-check), for an inference tensor (no version counter to key a verdict)
    or for a mask whose gradient is computed (its bias is what is differentiated)."""
    return patterns_on() and not capturing(mask) and not mask.is_inference() and not mask.requires_grad


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
    # bottom-right: row i ends at key i + S - L (at i + n_b - L where it pads); a window keeps W keys up to there
    window_br = (hi - lo + 1).amax()
    shortest = n.amin()  # the padding mask's shortest key length (MaskPattern.min_kv_len)
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
            (hi == row + s - lq).all(),
            (hi == row + n - lq).all(),
            (lo == (hi - window_br + 1).clamp(min=0)).all(),
        ]
    ).to(torch.int64)
    values = [checks, window.view(1), window_br.view(1), shortest.view(1)] + ([] if extra is None else [extra])
    values = torch.cat(values).tolist()
    pattern = _pattern_from(_Checks(*values[:14]), n, m, batch, lq, s)
    return pattern if extra is None else (pattern, values[14:])


class _Checks(NamedTuple):
    """What :func:`recognize` synchronized: each check of the whole mask (0 or 1), the two window lengths, then the
    shortest key length if it pads."""

    valid: int
    runs: int
    full: int
    causal: int
    padded: int
    causal_padded: int
    no_left: int
    windowed: int
    br_causal: int
    br_causal_padded: int
    br_windowed: int
    window: int
    window_br: int
    shortest: int


def _pattern_from(c: _Checks, n: torch.Tensor, m: torch.Tensor, batch: int, lq: int, s: int) -> Any:
    if not (c.valid and c.runs):
        return None
    lens = n.reshape(-1, 1, 1, 1).expand(batch, 1, 1, 1).to(torch.int32).contiguous()
    q_lens = torch.full((batch, 1, 1, 1), lq, dtype=torch.int32, device=m.device)
    if c.no_left or (c.windowed and lq <= s):  # cuDNN 9.19 refuses a left bound with L > S
        pattern = _top_left(c, q_lens, lens, lq)
        if pattern is not None:
            return pattern
    # Bottom-right (L = S: it is top-left; L = 1: all kept or padding, recognized above): keep j <= i + S - L
    # and, with a window, i + S - L - j < W; with key padding S is n_b (cuDNN aligns the band to seq_len_kv).
    # libcudnn 9.19 validates and builds it forward and backward at sm80-sm120 (the lowering sweep); the frontend
    # refuses it with dropout or a bias, which thunder_cudnn_safe.routing.planner therefore keeps as a bias.
    if 1 < lq < s and (c.no_left or c.br_windowed):
        left = None if c.no_left else int(c.window_br)
        if c.br_causal:
            return MaskPattern(0, left, bottom_right=True)
        if c.br_causal_padded:
            return MaskPattern(0, left, q_lens, lens, bottom_right=True, min_kv_len=int(c.shortest))
    return None


def _top_left(c: _Checks, q_lens: torch.Tensor, lens: torch.Tensor, lq: int) -> MaskPattern | None:
    # one query keeping key 0 only: padding, not a causal band (cudnn_rules.CAUSAL_DECODE_GQA)
    causal, causal_padded = (0, 0) if lq == 1 else (c.causal, c.causal_padded)
    left = None if c.no_left else int(c.window)
    if c.full and left is None:
        return MaskPattern(None, None, all_kept_lens=(q_lens, lens))
    if causal:
        return MaskPattern(0, left)
    if causal_padded:
        return MaskPattern(0, left, q_lens, lens, min_kv_len=int(c.shortest))
    if c.padded and left is None:
        return MaskPattern(None, None, q_lens, lens, min_kv_len=int(c.shortest))
    return None  # e.g. a window without the causal bound: not a form models produce
