"""Attention sinks on the dispatch memo's fast path (issue 48): cuDNN's float32 sink token is kept per sinks tensor,
written by each forward (no allocation) and read by its backward (no copy), and never read where the sinks changed.

What is counted is copies (``copy_stats()``, reason ``SINKS_LAYOUT``), never time: a token read is no copy, a token
made or written is. Numbers are compared exactly with a fresh dispatcher given a new tensor of the sinks' present
values (the emulated runtime is deterministic), and once with a float64 eager reference. An optimizer's in-place
update, a fused optimizer's (no version bump), a new sinks tensor at a freed one's address, ``.data =``, a view as
another dtype, CUDA-graph capture (the package's capture switch on CPU, as in tests/test_capture.py), inference
tensors, the cache off and threads must all stay exactly right.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from checks import dispatch_step

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing.sink_tokens import sink_tokens
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.telemetry import CopyReason
from thunder_cudnn_safe.testing import seeded_qkv

B, H, L, D = 2, 4, 32, 16


def _sinks(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _copies() -> int:
    """Sink tokens made or written since the last reset (each one counted copy of the sinks)."""
    return tcs.copy_stats().by_reason.get(("sinks", CopyReason.SINKS_LAYOUT), (0, 0))[0]


def _step(disp: Dispatcher, sinks: torch.Tensor, qkv: tuple | None = None) -> tuple:
    """One causal training step's attention with ``sinks``: (out, dq, dk, dv, dsinks)."""
    q, k, v = qkv or seeded_qkv(B, H, L, d=D)
    out, grads, _ = dispatch_step(disp, q, k, v, is_causal=True, sinks=sinks)
    return (out, *grads)


def _expected(sinks: torch.Tensor) -> tuple:
    """The step's results for a new tensor holding the sinks' present values, on a fresh dispatcher."""
    return _step(Dispatcher(EmulatedRuntime(), GraphCache(8)), sinks.detach().clone())


def _assert_equal(got: tuple, expected: tuple, where: str) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {name} {a.dtype} {a.shape}"
        assert torch.equal(a, b), f"{where}: {name} differs"


def _eager(sinks: torch.Tensor) -> tuple:
    """Causal attention with sinks in float64 (a sink column joins each row's softmax and is dropped), with the
    gradients of q, k, v and the sinks for dispatch_step's grad_out."""
    q, k, v = seeded_qkv(B, H, L, d=D)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    s = leaves[0] @ leaves[1].transpose(-1, -2) * D**-0.5
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    s = torch.cat([s, leaves[3].reshape(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
    out = torch.softmax(s, dim=-1)[..., :-1] @ leaves[2]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).double()
    return (out, *torch.autograd.grad(out, leaves, g))


def test_a_backward_reads_the_token_its_forward_wrote(fresh_cache):
    """Two layers, each with its own bf16 sinks, three steps: one token per layer, made by its first forward, written
    by each later forward (one copy) and read by each backward (none); the numbers are eager's, the gradient the
    sinks' dtype and shape."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    layers = [_sinks(1), _sinks(2)]
    first = [_step(disp, s) for s in layers]
    assert _copies() == 2, tcs.copy_stats()
    assert len(sink_tokens) == 2
    for _ in range(2):
        for i, s in enumerate(layers):
            _assert_equal(_step(disp, s), first[i], f"layer {i}")
    assert _copies() == 3 * 2, "a backward copied its sinks again"
    assert len(sink_tokens) == 2
    for i, s in enumerate(layers):
        assert first[i][4].dtype == torch.bfloat16 and first[i][4].shape == (H,)
        for name, got, ref in zip(("out", "dq", "dk", "dv", "dsinks"), first[i], _eager(s), strict=True):
            err = (got.double() - ref).abs().max().item()
            assert err < 3e-2, f"layer {i}: {name} off by {err}"


def test_sinks_updated_in_place_between_steps_give_the_new_values(fresh_cache):
    """An optimizer step writes the sinks in place (their version bumps): the next step makes a new token from the
    new values, once, for its forward and backward."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks = _sinks(1)
    before = _step(disp, sinks)
    for i in range(3):
        with torch.no_grad():
            sinks.add_(1.5)  # as an optimizer updates a parameter
        got = _step(disp, sinks)
        _assert_equal(got, _expected(sinks), f"after update {i}")
        assert not torch.equal(got[0], before[0]), "the update changed nothing"
    assert _copies() == 1 + 3 + 3, "one per forward here, one per fresh dispatcher's new tensor"


def test_a_new_sinks_tensor_each_step_runs_its_own_values(fresh_cache):
    """A new sinks tensor each step, the previous one freed: the new one sits at its address with the same version
    (two tensors over one numpy buffer, one after the other: deterministically the same address), and only the
    freed storage tells them apart."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    memory = np.zeros(H, dtype=np.int16)
    kept = len(sink_tokens._tokens)
    for seed in range(3):
        sinks = torch.from_numpy(memory).view(torch.bfloat16)
        with torch.no_grad():
            sinks.copy_(_sinks(seed))
        _assert_equal(_step(disp, sinks), _expected(sinks), f"step {seed}")
        del sinks  # its storage freed: the next step's tensor is at its address
    assert len(sink_tokens._tokens) == kept, "a token outlived its sinks (weak: dropped with their storage)"


def test_sinks_given_another_storage_at_their_address_run_their_new_values(fresh_cache):
    """``sinks.data = t`` gives the sinks another storage with no version bump; ``t`` at the old storage's address
    (two tensors over one numpy buffer), the old storage still alive (a tensor saved for a backward holds it):
    identity, address and version all match the last call, the storage does not."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    memory = np.zeros(H, dtype=np.int16)
    sinks = torch.from_numpy(memory).view(torch.bfloat16)
    sinks.copy_(_sinks(1))
    _step(disp, sinks)
    saved = sinks.detach()  # noqa: F841 (keeps the old storage alive)
    other = torch.from_numpy(memory).view(torch.bfloat16)  # another storage at the same address
    with torch.no_grad():
        other.copy_(_sinks(2))
    version = sinks._version
    sinks.data = other
    assert sinks._version == version and sinks.data_ptr() == other.data_ptr()
    _assert_equal(_step(disp, sinks), _expected(_sinks(2)), "after the swap")


def test_a_view_of_the_sinks_as_another_dtype_has_its_own_token(fresh_cache):
    """bf16 sinks read as float16 share their storage, address and version: another token, from those values."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks = _sinks(1)
    _step(disp, sinks)
    as_half = sinks.view(torch.float16)
    _assert_equal(_step(disp, as_half), _expected(as_half), "float16 view")
    _assert_equal(_step(disp, sinks), _expected(sinks), "bf16 again")


def test_a_negated_view_of_the_sinks_has_its_own_token(fresh_cache):
    """A negated view (torch's neg bit: ``z.conj().imag`` of a complex tensor, ``torch._neg_view``) shares the sinks'
    storage, address, dtype, strides and version but reads their negation: two layers, one with each, run both
    forwards before either backward (as a training step does); each backward reads its own sinks' values."""
    z = torch.randn(H, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    sinks, negated = z.imag, z.conj().imag  # float32 with stride 2: a token, not bound as they are
    assert negated.is_neg() and negated.data_ptr() == sinks.data_ptr() and torch.equal(negated, -sinks)
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    forwards = [(s, disp.forward(q, k, v, None, 0.0, True, sinks=s)) for s in (sinks, negated)]
    for s, (out, stats) in forwards:
        expected = _backward(Dispatcher(EmulatedRuntime(), GraphCache(8)), s.clone(), out, stats)
        got = _backward(disp, s, out, stats)
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, expected, strict=True):
            assert torch.equal(a, b), f"negated {s.is_neg()}: {name} differs"


def test_float32_sinks_are_bound_as_they_are(fresh_cache):
    """Packed float32 sinks are cuDNN's sink token already: no copy, none kept; the gradient is float32 (H,)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks = _sinks(1, torch.float32)
    kept = len(sink_tokens)
    for _ in range(3):
        got = _step(disp, sinks)
    assert _copies() == 0, tcs.copy_stats()
    assert len(sink_tokens) == kept
    assert got[4].dtype == torch.float32 and got[4].shape == (H,)
    _assert_equal(got, _expected(sinks), "float32")


def test_under_capture_each_call_makes_its_own_token(fresh_cache, monkeypatch):
    """While a stream captures, no kept token is read and none is kept: the capture must record making it, so
    every replay reads the sinks' values then. The package's capture switch stands in for the capturing stream."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks, new = _sinks(1), _sinks(2)
    for _ in range(2):  # warm-up: one token, written by each forward
        _step(disp, sinks)
    assert _copies() == 2 and len(sink_tokens) == 1
    kept = sink_tokens._tokens[sinks.data_ptr()].token
    with monkeypatch.context() as capture:
        capture.setattr(bias, "capturing", lambda t: True)
        for _ in range(2):
            got = _step(disp, sinks)
            _step(disp, new)
        assert _copies() == 2 + 2 * 2 * 2, "a kept token was read under capture"
        assert len(sink_tokens) == 1, "a token made under capture was kept"
    assert sink_tokens._tokens[sinks.data_ptr()].token is kept
    _assert_equal(got, _expected(sinks), "captured")


def test_inference_sinks_and_the_cache_off_copy_every_call(fresh_cache):
    """An inference tensor has no version counter (an in-place write would go unseen) and ``mask_cache_size = 0``
    keeps no conversion: every call makes its token."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    with torch.inference_mode():
        sinks = _sinks(1)
        for _ in range(2):
            disp.forward(*seeded_qkv(B, H, L, d=D), is_causal=True, sinks=sinks)
        assert _copies() == 2
        sinks.add_(1.0)
        got = disp.forward(*seeded_qkv(B, H, L, d=D), is_causal=True, sinks=sinks)[0]
    assert torch.equal(got, _expected(sinks)[0])
    with tcs.config.patch(mask_cache_size=0):
        disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
        sinks, copies = _sinks(3), _copies()
        for _ in range(2):
            _step(disp, sinks)
        assert _copies() == copies + 2 * 2
        assert len(sink_tokens) == 0


def test_a_token_made_under_inference_mode_serves_the_training_steps_after(fresh_cache):
    """A model's (normal) sinks run first under ``torch.inference_mode()`` (an evaluation, a generation), then in
    training: the token kept by the inference forward is written by the training forwards (a tensor made under
    inference mode is an inference tensor, which no write outside it may touch), and the other way round."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks = torch.nn.Parameter(_sinks(1))
    with torch.inference_mode():
        disp.forward(*seeded_qkv(B, H, L, d=D), is_causal=True, sinks=sinks.detach())
    assert len(sink_tokens) == 1
    for step in range(2):
        _assert_equal(_step(disp, sinks.detach()), _expected(sinks), f"training step {step}")
        with torch.no_grad():
            sinks.add_(0.5)
        with torch.inference_mode():
            got = disp.forward(*seeded_qkv(B, H, L, d=D), is_causal=True, sinks=sinks.detach())[0]
        assert torch.equal(got, _expected(sinks)[0]), f"inference after step {step}"
    # one per forward (made or written; no backward copies), each fresh dispatcher's forward included
    assert _copies() == 1 + 2 * (1 + 1 + 1 + 1), tcs.copy_stats()


def test_threads_with_their_own_sinks_share_one_signature(fresh_cache):
    """Threads running one signature at once, each with its own sinks (some written in place between steps): each
    gets its own sinks' numbers on every call."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks = [_sinks(i) for i in range(4)]
    barrier, errors = threading.Barrier(len(sinks)), []

    def run(i: int) -> None:
        try:
            barrier.wait()
            for step in range(10):
                if i % 2 and step % 3 == 2:
                    with torch.no_grad():
                        sinks[i].mul_(-1.0)
                _assert_equal(_step(disp, sinks[i]), _expected(sinks[i]), f"thread {i}, step {step}")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sinks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_sinks_updated_by_a_fused_optimizer_give_the_new_values(fresh_cache):
    """torch's fused optimizers (``fused=True``: ``_fused_adamw_``) write the parameters without bumping their
    ``_version`` (torch 2.11, CPU and CUDA alike: the version counter is bumped above the device kernels), so no
    kept token may outlive a forward: each forward writes the sinks' present values, its backward reads them."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks = torch.nn.Parameter(_sinks(1))
    opt = torch.optim.AdamW([sinks], lr=0.5, fused=True)
    for step in range(3):
        got = _step(disp, sinks.detach())
        _assert_equal(got, _expected(sinks), f"step {step}")
        sinks.grad = got[4]
        before = sinks.detach().clone()
        opt.step()
        assert not torch.equal(before, sinks.detach()), "the optimizer changed nothing"


def _backward(disp: Dispatcher, sinks: torch.Tensor, out: torch.Tensor, stats: torch.Tensor) -> tuple:
    q, k, v = seeded_qkv(B, H, L, d=D)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    return disp.backward(g, q, k, v, None, 0.0, True, out, stats, None, None, sinks=sinks)


@pytest.mark.parametrize("change", ["written in place", "another storage at its address", "viewed as float16"])
def test_a_backward_reads_no_token_of_sinks_changed_since_its_forward(change, fresh_cache):
    """The sinks changed between a forward and a backward (no forward in between to write the token): the
    backward reads the kept token only where the sinks are the storage, dtype and version its forward wrote, and
    otherwise makes its own from their present values."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    memory = np.zeros(H, dtype=np.int16)
    sinks = torch.from_numpy(memory).view(torch.bfloat16)
    sinks.copy_(_sinks(1))
    out, stats = disp.forward(*seeded_qkv(B, H, L, d=D), is_causal=True, sinks=sinks)
    saved = sinks.detach()  # noqa: F841 (keeps the old storage alive, as autograd's saved tensors would)
    if change == "written in place":
        with torch.no_grad():
            sinks.add_(1.5)
    elif change == "another storage at its address":
        other = torch.from_numpy(memory).view(torch.bfloat16)
        with torch.no_grad():
            other.copy_(_sinks(2))
        sinks.data = other
    else:
        sinks = sinks.view(torch.float16)
    expected = _backward(Dispatcher(EmulatedRuntime(), GraphCache(8)), sinks.clone(), out, stats)
    got = _backward(disp, sinks, out, stats)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        assert torch.equal(a, b), f"{change}: {name} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_sinks_gradient_buffer_is_zeroed_before_the_graph_runs(dtype, fresh_cache, monkeypatch):
    """cuDNN adds each batch element's and query's share of dSink_token into its buffer (an ADD reduction; the
    emulation does the same), so the recipe hands it a zeroed buffer, however the buffer is allocated: every buffer
    allocated uninitialized is NaN here (the dispatcher's recipes are compiled after the patch)."""
    sinks = _sinks(1, dtype)
    expected = _expected(sinks)
    for name in ("empty_like", "empty_strided"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, real=real, **kw: real(*a, **kw).fill_(float("nan")))
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    for _ in range(2):
        _assert_equal(_step(disp, sinks), expected, str(dtype))


def test_a_kept_token_holds_no_autograd_history_under_grad_mode(fresh_cache):
    """A dispatcher called directly with grad mode on and sinks that require grad: writing them into the kept token
    must not record the copy (each write would chain one more node onto the token's history, kept for as long as
    the token, growing every call). thunder and attention() run forwards with grad mode off; this guards the rest."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    sinks = _sinks(1).requires_grad_()
    q, k, v = seeded_qkv(B, H, L, d=D)
    for _ in range(3):
        disp.forward(q, k, v, is_causal=True, sinks=sinks)
    tokens = [entry.token for entry in sink_tokens._tokens.values() if entry.storage() is not None]
    assert tokens, "no token kept"
    assert all(t.grad_fn is None and not t.requires_grad for t in tokens), "the kept token records autograd history"


def test_each_forwards_write_is_counted_exactly_across_resets_and_threads(fresh_cache):
    """A kept token's write is counted by a lock-free tally (one per operand, reason and size), not the copy counter's
    locked dict: the counts and bytes stay exact from threads writing one token at once, and a reset zeroes them."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    sinks = _sinks(1)
    q, k, v = seeded_qkv(B, H, L, d=D)
    disp.forward(q, k, v, is_causal=True, sinks=sinks)  # the token made: one counted copy
    tcs.reset_copy_stats()
    assert _copies() == 0, tcs.copy_stats()
    disp.forward(q, k, v, is_causal=True, sinks=sinks)
    assert tcs.copy_stats().by_reason[("sinks", CopyReason.SINKS_LAYOUT)] == (1, H * 4)
    barrier, calls = threading.Barrier(4), 200

    def run() -> None:
        barrier.wait()
        for _ in range(calls):
            disp.forward(q, k, v, is_causal=True, sinks=sinks)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = tcs.copy_stats()
    assert stats.by_reason[("sinks", CopyReason.SINKS_LAYOUT)] == (1 + 4 * calls, (1 + 4 * calls) * H * 4), stats
    assert stats.copies == 1 + 4 * calls and stats.bytes_copied == (1 + 4 * calls) * H * 4
    tcs.reset_copy_stats()
    assert _copies() == 0 and tcs.copy_stats().copies == 0
