"""Calls that hit a known cuDNN defect with a documented workaround are built with the workaround.

:data:`~thunder_cudnn_safe.rules.cudnn_rules.HOPPER_DECODE_BACKWARD_NAN` (NVIDIA/cudnn-frontend#1072; its text
says why): a training call with ``s_q == 1`` on sm90 runs its forward and backward with a padding pattern
keeping every key (the lengths are the tensors' own, the numbers those of the unpadded graph). A mask tensor
is declined at trace time, so only a call without one, or with a pattern that does not pad yet, is routed.
"""

from __future__ import annotations

import torch

from thunder_cudnn_safe.layouts.keys import Target
from thunder_cudnn_safe.masks.patterns import MaskPattern
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall
from thunder_cudnn_safe.rules import cudnn_rules


def route(
    call: ForwardCall | BackwardCall, target: Target, lens_device: torch.device | str | None = None
) -> ForwardCall | BackwardCall:
    """``call`` (a pattern already swapped in) as it must run on ``target``: with the workaround where needed.
    ``lens_device``: where the padding lengths are made (default: the query's device; ``"meta"`` to plan
    keys without running anything, as :func:`~thunder_cudnn_safe.routing.planner.planned_keys` does)."""
    q, k = call.query, call.key
    backward_follows = isinstance(call, BackwardCall) or bool(call.need_stats)
    if q.shape[2] != 1 or not cudnn_rules.HOPPER_DECODE_BACKWARD_NAN.declines(target, backward_follows):
        return call
    mask = call.attn_mask
    if mask is None:
        right, left = (0 if call.is_causal else None), None
    elif isinstance(mask, MaskPattern) and mask.kv_lens is None and mask.all_kept_lens is None:
        right, left = mask.right, mask.left
    else:
        return call  # pads already, or a bias (declined at trace time)
    b, device = q.shape[0], q.device if lens_device is None else lens_device
    q_lens, kv_lens = (torch.full((b, 1, 1, 1), n, dtype=torch.int32, device=device) for n in (1, k.shape[2]))
    pattern = MaskPattern(right, left, q_lens, kv_lens, min_kv_len=k.shape[2])  # every key: no dK/dV row unwritten
    return call._replace(attn_mask=pattern, is_causal=False)
