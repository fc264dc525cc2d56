"""``describe()`` runs no kernel (its docstring's promise), except recognizing a mask not seen before.

On CPU, a ``TorchDispatchMode`` stands for a runtime that records launches: it sees every aten op on
a real (non-meta) tensor, so any fill, comparison, copy or host sync ``describe()`` makes is recorded.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import thunder_cudnn_safe as tcs

#: Ops that only describe a tensor already there (views, metadata), no kernel.
_NO_KERNEL = {"as_strided", "view", "t", "transpose", "expand", "unsqueeze", "select", "slice", "detach", "alias"}


class RecordLaunches(TorchDispatchMode):
    """Records the aten ops that would launch a kernel: those with a real (non-meta) tensor result."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        results = out if isinstance(out, (tuple, list)) else (out,)
        on_meta = any(isinstance(r, torch.Tensor) and r.is_meta for r in results)
        if not on_meta and name not in _NO_KERNEL:  # a real result, or a Python scalar (a host sync)
            self.launches.append(name)
        return out


def _launches(*args, **kwargs) -> tuple[list[str], tcs.CallReport]:
    with RecordLaunches() as mode:
        report = tcs.describe(*args, executor="cudnn_safe_emulated", **kwargs)
    return mode.launches, report


def test_describe_of_a_routed_decode_fills_no_lengths(fresh_cache):
    """An sm90 training decode runs with the padding mask at full lengths (defect_routes): describe()
    filled two length tensors on the call's device to plan that key; now it plans them on meta."""
    with tcs.config.patch(emulated_arch=(9, 0), emulated_backend=91900):
        q, k, v = torch.randn(2, 2, 1, 64).half(), torch.randn(2, 2, 32, 64).half(), torch.randn(2, 2, 32, 64).half()
        launches, report = _launches(q, k, v)
        assert report.reasons == [] and report.mask_pattern is None
        assert launches == []
        disp = tcs.emulated_ex.dispatcher
        out, stats = disp.forward(q, k, v, None, 0.0, False)
        disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
        launches, report = _launches(q, k, v)
        assert launches == [] and report.forward.key.padded and report.backward is not None


def test_describe_recognizes_a_new_mask_once_then_runs_nothing(fresh_cache):
    q, k, v = (torch.randn(2, 2, 16, 64).bfloat16() for _ in range(3))
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    mask[0, ..., 10:] = False  # padding
    first, report = _launches(q, k, v, mask)
    assert report.mask_pattern == "padding" and first  # the documented exception: its comparisons, one sync
    again, report = _launches(q, k, v, mask)
    assert again == [] and report.mask_pattern == "padding"
    assert _launches(q, k, v)[0] == []
