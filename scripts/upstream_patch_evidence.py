#!/usr/bin/env python3
"""CPU evidence for upstream/cudnn_sdpa.patch: max |error| vs float64, unpatched vs patched vs eager torch.

    PYTHONPATH=. python scripts/upstream_patch_evidence.py

Patches a temporary copy of the installed thunder's ``thunder/executors/cudnn_sdpa.py`` with
``git apply``, loads both copies, stubs the GPU-only calls and runs ``_cudnn_sdpa_fwd_impl`` /
``_cudnn_sdpa_bwd_impl`` on the emulated cuDNN (which reads each bound tensor through its
*declared* layout, as cuDNN does). Inputs: the diffusers case of the issue, q/k/v and grad_out
(2, 8, 64, 96) in BSHD storage seen as BHSD (strides (49152, 96, 768, 1)), uniform in [-1, 1],
seed 0; and the same q/k/v with a (1, 8, 64, 64) additive mask stored as (64, 8, 64).
Prints a Markdown table for upstream/PR.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import thunder
import torch
import torch.nn.functional as F
from support.upstream_patch import apply_patch, installed_thunder_file, load_private, stub_gpu_calls

import thunder_cudnn_safe  # noqa: F401  (compat steps, then thunder)

B, H, L, D = 2, 8, 64, 96


def _bshd_as_bhsd(dtype):
    return (torch.rand(B, L, H, D, dtype=torch.float64) * 2 - 1).to(dtype).transpose(1, 2)


def _errors(mod, dtype, with_mask):
    torch.manual_seed(0)
    q, k, v, g = (_bshd_as_bhsd(dtype) for _ in range(4))
    mask = (
        (torch.randn(L, H, L, dtype=torch.float64) * 2).to(dtype).permute(1, 0, 2).unsqueeze(0) if with_mask else None
    )
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves64, attn_mask=None if mask is None else mask.double())
    ref_grads = torch.autograd.grad(ref, leaves64, g.double())
    if mod is None:  # eager torch in the inputs' precision
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        grads = torch.autograd.grad(out, leaves, g)
    else:
        out, stats, seed, offset = mod._cudnn_sdpa_fwd_impl(q, k, v, mask, 0.0, False, scale=None)
        grads = mod._cudnn_sdpa_bwd_impl(
            g, q, k, v, mask, 0.0, False, out, stats, seed, offset, scale=None, cat_grad_qkv=False
        )[:3]
    return [(a.double() - b).abs().max().item() for a, b in zip((out, *grads), (ref, *ref_grads))]


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        applied = apply_patch(installed_thunder_file(), Path(work))
        old = load_private("_evidence_unpatched", applied.original)
        new = load_private("_evidence_patched", applied.patched)
        with pytest.MonkeyPatch.context() as mp:
            stub_gpu_calls(mp, [old, new])
            print(f"lightning-thunder {thunder.__version__}, torch {torch.__version__}\n")
            print(
                "| case | dtype | unpatched out / dq / dk / dv | patched out / dq / dk / dv | eager "
                "torch out / dq / dk / dv |"
            )
            print("|---|---|---|---|---|")
            for case, with_mask in (("transposed grad_out", False), ("strided mask", True)):
                for dtype in (torch.float16, torch.bfloat16):
                    cells = [" / ".join(f"{e:.2g}" for e in _errors(m, dtype, with_mask)) for m in (old, new, None)]
                    print(f"| {case} | {str(dtype)[6:]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
