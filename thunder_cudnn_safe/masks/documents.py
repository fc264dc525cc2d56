"""Packed sequences: a block-diagonal document mask recognized exactly, as per-document lengths.

Padding-free training (transformers 5 with ``position_ids`` restarting per document, no attention
mask) hands SDPA a (B, 1, T, T) mask that keeps, for query i of document [a, b) in its row, the keys
a <= j <= i (causal), a <= j < b (not causal), or a <= j <= i with i - j < W (a sliding window).
cuDNN runs that as variable-length attention (:mod:`~thunder_cudnn_safe.routing.varlen`): each document its
own sequence, no bias read, no cross-document score computed.

Recognition is exact, over the whole mask: each row's kept keys must be one run [lo, hi] whose ends
are exactly the ones the documents imply (documents are contiguous; a row that starts a run at its
own position starts a document). Rows keeping no key must form a suffix of the row (tokens outside
every document: eager gives them 0, as the varlen path does). Anything else is not a document mask.
One host sync per distinct mask (the verdict, with N and the longest document); the per-document
token starts and lengths stay on the device. :mod:`patterns` syncs these checks with its own (one sync per
mask) and takes documents only where it found no pattern,
under the same cache and capture rules (no verdict under CUDA-graph capture).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class DocumentPattern(NamedTuple):
    """A packed-sequence mask: documents of ``rows`` rows of ``tokens`` tokens, in row order.

    ``starts`` (n_docs,) int64 is each document's first token in the flattened rows x tokens buffer
    (row * tokens + start); ``lens`` (n_docs,) int32 its length. ``left``: the sliding window
    (keep i - j < left), or None."""

    causal: bool
    left: int | None
    n_docs: int
    max_len: int
    rows: int
    tokens: int
    starts: Any
    lens: Any
    #: device tensors derived from this pattern (lengths, offsets per token stride), made once per distinct
    #: mask rather than once per layer (:mod:`~thunder_cudnn_safe.routing.varlen`); never under capture
    #: (no pattern then)
    derived: Any = None

    @property
    def name(self) -> str:
        return "documents" + ("+causal" if self.causal else "") + ("+window" if self.left is not None else "")


def as_4d(mask: torch.Tensor, lq: int, s: int) -> torch.Tensor | None:
    """``mask`` with its missing leading dims as 1 (4-D), or None where its last two are not (lq, s) or are empty."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (lq, s) or 0 in (lq, s):
        return None
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def kept_runs(m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What both recognizers read off mask ``m`` (no host sync): ``valid`` (a float mask keeps 0 and masks only
    with -inf or values <= its dtype's lowest finite value), then each row's count of kept keys and its first
    and last kept key (by argmax: temporaries of a few bytes per mask element)."""
    if m.dtype == torch.bool:
        keep, valid = m, torch.ones((), dtype=torch.bool, device=m.device)
    else:
        keep = m == 0
        valid = (keep | (m <= torch.finfo(m.dtype).min)).all()
    k8 = keep.view(torch.uint8)
    return valid, keep.sum(-1), k8.argmax(-1), m.shape[-1] - 1 - k8.flip(-1).argmax(-1)


def recognize_documents(mask: torch.Tensor, batch: int, lq: int, s: int) -> DocumentPattern | None:
    """``mask`` (broadcastable to (batch, H, lq, s)) as documents, or None; one host sync. Only square masks
    (lq == s: a packed row attends to itself) whose head dim is 1 or broadcast."""
    checked = document_checks(mask, batch, lq, s)
    return None if checked is None else document_verdict(checked[0].tolist(), checked[1], batch, lq)


def document_checks(mask: torch.Tensor, batch: int, lq: int, s: int) -> tuple[torch.Tensor, tuple] | None:
    """The device half of :func:`recognize_documents`, no host sync: (the checks as a 1-D int64 tensor, the
    state :func:`document_verdict` needs), or None where the shape alone rules documents out."""
    m = as_4d(mask, lq, s) if lq == s else None
    if m is None or m.shape[0] not in (1, batch) or (m.shape[1] > 1 and m.stride(1) != 0):
        return None  # per-head masks are not documents
    m = m[:, 0]
    valid, count, lo, hi = kept_runs(m)  # count: (Bm, T)
    if m.dtype != torch.bool:
        # a row masked with finite lowest values is not dead: eager averages V over it (its scores tie),
        # while a token outside every document gets 0; only a row of -inf is outside (safe softmax: 0)
        valid = valid & (torch.isneginf(m).all(-1) | (count > 0)).all()
    row = torch.arange(lq, device=m.device).expand_as(lo)
    cov = count > 0
    first = cov & (lo == row)  # a row whose run starts at itself starts a document
    start = torch.cummax(torch.where(first, row, torch.zeros_like(row)), dim=-1).values
    # one past each document's last token: the next start, or the first token outside every document
    ends = torch.nn.functional.pad(torch.where(first | ~cov, row, lq)[:, 1:], (0, 1), value=lq)  # shifted left
    end = ends.flip(-1).cummin(-1).values.flip(-1)
    window = torch.where(cov, row - lo + 1, torch.zeros_like(row)).amax()
    doc_len = torch.where(first, end - row, torch.zeros_like(row))
    causal_lo = torch.maximum(start, row - window + 1)
    checks = torch.stack(
        [
            valid,
            (~cov | (hi - lo + 1 == count)).all(),  # every row keeping a key keeps one run
            (cov[:, :-1] | ~cov[:, 1:]).all(),  # rows keeping no key are a suffix
            (~cov | ((hi == row) & (lo == start))).all(),  # causal, no window
            (~cov | ((hi == row) & (lo == causal_lo))).all(),  # causal, window
            (~cov | ((hi == end - 1) & (lo == start))).all(),  # not causal
            cov.any(),
        ]
    ).to(torch.int64)
    stats = torch.cat([checks, window.view(1), doc_len.amax().view(1), first.sum().view(1)])
    return stats, (first, doc_len, m.shape[0], m.device)


def document_verdict(values: list[int], state: tuple, batch: int, lq: int) -> DocumentPattern | None:
    """The host half of :func:`recognize_documents`: the pattern from the synchronized checks, or None."""
    first, doc_len, mask_rows, device = state
    valid, runs, prefix, causal, windowed, full, any_kept, window, max_len, n_row_docs = values
    if not (valid and runs and prefix and any_kept and (causal or windowed or full)):
        return None
    is_causal = bool(causal or windowed)
    # a window at least as wide as every document changes nothing
    left = int(window) if windowed and not causal and window < max_len else None
    if mask_rows == 1 and batch > 1:
        first, doc_len = first.expand(batch, lq), doc_len.expand(batch, lq)
        n_row_docs *= batch
    flat = first.reshape(-1)
    index = torch.where(flat, flat.cumsum(0) - 1, torch.full_like(flat, n_row_docs, dtype=torch.int64))
    tokens = torch.arange(batch * lq, device=device)
    starts = torch.zeros(n_row_docs + 1, dtype=torch.int64, device=device).scatter_(0, index, tokens)
    lens = torch.zeros(n_row_docs + 1, dtype=torch.int64, device=device).scatter_(0, index, doc_len.reshape(-1))
    return DocumentPattern(
        is_causal, left, int(n_row_docs), int(max_len), batch, lq, starts[:-1], lens[:-1].to(torch.int32), {}
    )
