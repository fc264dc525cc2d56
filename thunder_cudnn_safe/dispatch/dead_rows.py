"""Eager's "safe softmax" where a mask runs as cuDNN's bias: a query row masked everywhere gives zeros.

A flash kernel gives NaN for a row whose every key is masked with -inf (poisoning dV of the whole batch
element); eager gives zeros and no gradient. The rows are found once per distinct mask and state (the
converted-mask cache), not per call.
"""

from __future__ import annotations

from typing import Any

import torch

from thunder_cudnn_safe.layouts.keys import Uid
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing.recipes import Bound

#: ``dead`` of :func:`zero_fully_masked_rows` where no rows were kept: read them (once per mask and state).
UNREAD = "unread"


def zero_fully_masked_rows(mask: torch.Tensor, bound: Bound, dead: Any = None) -> torch.Tensor | None:
    """Eager's "safe softmax" for a query row whose every key is masked with -inf: zeros, no gradient. A flash
    kernel gives NaN there (poisoning dV of the whole batch element). The dead rows of a forward run with a bias
    are set to 0 and their stats to +inf, so the backward recomputes P = 0 for them. No host synchronization per
    call; none at all where no row is dead (:func:`fully_masked_rows`). ``dead``: the rows, where the caller kept
    them for this mask's state (a memo hit: :mod:`.replay`), else :data:`UNREAD`; returns the rows."""
    if dead is UNREAD:
        dead = fully_masked_rows(mask, bound.pack[Uid.BIAS])
    if dead is None:
        return None
    bound.outputs[0].masked_fill_(dead, 0.0)
    if Uid.STATS in bound.pack:
        bound.pack[Uid.STATS].masked_fill_(dead, float("inf"))
    return dead


def fully_masked_rows(mask: torch.Tensor, bias_tensor: torch.Tensor) -> torch.Tensor | None:
    """Which query rows of ``bias_tensor`` (bound for ``mask``) mask every key with -inf, broadcastable to (B, H, L, 1);
    None where the mask is kept and none is (one host sync per distinct mask spares two masked fills per call: most
    biases, ALiBi or relative positions, leave every row a key).

    Read once per distinct mask and state, not per call (a (1, 32, 4096, 4096) bf16 bias is 1 GiB read again per
    forward): kept in the converted-mask cache (:mod:`~thunder_cudnn_safe.masks.bias`) by the mask's storage,
    layout and ``_version``, as its conversion and its pattern verdict are; an in-place write reads them again.
    A write torch does not version (``.data``, an aliased numpy array) is not seen, as for those:
    ``config.mask_cache_size = 0`` reads them on every call. Read off the mask's own elements where the bias is a
    view of it, never its (B, H, L, S) broadcast, so the read costs what the mask holds, not the scores.

    Not derived from the forward's own stats (a row with no visible key should have a logsumexp of -inf): no
    public source says what cuDNN writes there, so that route waits for a GPU check."""
    own = bias_tensor.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
    keeps = bias.converted_masks.keeps(mask)

    def rows() -> torch.Tensor | None:
        dead = torch.isneginf(mask if own else bias_tensor).all(dim=-1, keepdim=True)
        return dead if not keeps or bool(dead.any()) else None  # a host sync only for a mask kept

    how = ("fully masked rows", tuple(bias_tensor.shape), bias_tensor.stride(), bias_tensor.dtype)
    return bias.converted_masks.get(mask, how, rows, count=False)
