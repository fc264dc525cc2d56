"""Packed sequences per training step: mask bytes read and scores computed, bias path vs variable-length path.

A padding-free row of T tokens holding n equal documents reaches SDPA as a (B, 1, T, T) boolean
block-diagonal causal mask (transformers 5). As a bias, every layer's forward and backward read the
(B, 1, T, T) bias and compute all T^2 scores per head; as variable-length attention (issue 30) they
read only the lengths and ragged offsets and compute each document's causal triangle. The mask is
recognized by the package (:func:`thunder_cudnn_safe.masks.documents.recognize_documents`), the counts
come from :func:`thunder_cudnn_safe.routing.varlen.varlen_work` / :func:`~thunder_cudnn_safe.routing.varlen.bias_work`
and are checked against the closed forms: bias B*T^2*2 bytes and B*H*T^2 scores per pass, varlen
H*n*L(L+1)/2 scores (L = T/n). Counts, not timings: no GPU ran this.

    python -m benchmarks.packed_sequences [--tokens 4096] [--docs 1 4 8 32] [--heads 32] [--layers 32]
"""

from __future__ import annotations

import argparse

from thunder_cudnn_safe.masks import patterns
from thunder_cudnn_safe.masks.documents import recognize_documents
from thunder_cudnn_safe.routing import varlen
from thunder_cudnn_safe.testing import document_mask


def measure(tokens: int, docs: int, heads: int, layers: int) -> dict:
    mask = document_mask([[tokens // docs] * docs], tokens)  # HF's mask for ``docs`` equal causal documents
    # one document covering the row is today's causal pattern (no bias either); documents otherwise
    p = patterns.recognize(mask, 1, tokens, tokens) if docs == 1 else None
    doc = recognize_documents(mask, 1, tokens, tokens)
    assert doc is not None and doc.n_docs == docs and doc.causal and doc.left is None, doc
    per_pass_var, per_pass_bias = varlen.varlen_work(doc, heads), varlen.bias_work(1, heads, tokens)
    n_len = tokens // docs
    assert per_pass_bias.scores == heads * tokens * tokens and per_pass_bias.mask_bytes == tokens * tokens * 2
    assert per_pass_var.scores == heads * docs * n_len * (n_len + 1) // 2
    passes = 2 * layers  # forward and backward of every layer
    return {
        "docs": docs,
        "today": "causal pattern" if p is not None and p.right == 0 else "bias",
        "bias_mask_bytes": per_pass_bias.mask_bytes * passes,
        "varlen_mask_bytes": per_pass_var.mask_bytes * passes,
        "bias_scores": per_pass_bias.scores * passes,
        "varlen_scores": per_pass_var.scores * passes,
    }


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.3g} {prefix}{unit}" if prefix else f"{int(n)} {unit}"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--docs", type=int, nargs="+", default=[1, 4, 8, 32])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args(argv)
    print(f"T = {args.tokens}, B = 1, H = {args.heads}, {args.layers} layers, per training step (forward + backward)")
    print()
    print(
        "| documents | ran as before | bias: mask bytes | varlen: mask bytes "
        "| bias: scores | varlen: scores | scores saved |"
    )
    print("|---|---|---|---|---|---|---|")
    for docs in args.docs:
        r = measure(args.tokens, docs, args.heads, args.layers)
        print(
            f"| {docs} | {r['today']} | {_human(r['bias_mask_bytes'])} | {_human(r['varlen_mask_bytes'])} | "
            f"{r['bias_scores']:.3e} | {r['varlen_scores']:.3e} | {r['bias_scores'] / r['varlen_scores']:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
