"""LitGPT's hand-written Gemma-2 attention runs as the executor's fused call (issue 43).

LitGPT never calls F.sdpa when ``attention_logit_softcapping`` is set: it writes ``q @ k.mT * scale``, the softcap,
an additive causal or sliding-window mask, a float32 softmax and ``@ v`` by hand, after ``repeat_interleave``-ing
K/V (GQA). Under ``thunder.jit`` that is a chain of ops with a (B, H, L, S) score tensor per layer; with
``FuseHandwrittenAttention`` every layer must run as one ``cudnn_safe.attention`` call, claimed forward and
backward, with no score tensor left, and the training step must stay within the accuracy rule against a float64
eager copy. The baseline (no transform) shows that the score tensors are there to find, so the checks can fail.

A tiny random config, no downloads. litgpt 0.5.13 pins huggingface-hub<1.4, which transformers 5 cannot share, so
it is not in the ``test`` extra: ``.ci/run`` installs it without its dependencies (README: the LitGPT tests'
set-up line). Without litgpt the module skips.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable

import pytest
import thunder
import torch
import torch.nn.functional as F
from checks import on_the_runtime, score_tensors

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference

#: the models tier (.ci/run runs it): a tiny-model training step per test, ~20 s each on 2 cores, too long for the
#: default tier's budget
pytestmark = pytest.mark.models
_torch_compile = torch.compile
litgpt = pytest.importorskip("litgpt")
# litgpt imports lightning.fabric, which replaces torch.compile process-wide with a wrapper that deep-copies its
# keyword arguments: a ThunderCompiler backend holds locks, so every later ThunderFX test in this process (pytest
# imports this module at collection, whatever the tier) failed with "cannot pickle '_thread.lock'". Undo it.
torch.compile = _torch_compile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))  # harness.py's folder (its conftest's too)
from harness import OUR_BWD, OUR_FWD, _count_trace_symbols, _grads  # noqa: E402

B, L = 2, 12  # L != head_size and B > 1: no other tensor of the step has a score tensor's shape
N_LAYER, N_HEAD, N_QUERY_GROUPS, HEAD_SIZE = 2, 4, 2, 16
SEED = 1234


def _config():
    """Gemma 2 in miniature: softcapped logits, sliding-window then full layers, grouped heads (4 over 2)."""
    return litgpt.Config(
        name="tiny-gemma-2",
        block_size=32,
        vocab_size=64,
        padding_multiple=64,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_query_groups=N_QUERY_GROUPS,
        head_size=HEAD_SIZE,
        n_embd=32,
        intermediate_size=64,
        bias=False,
        rotary_percentage=1.0,
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="GemmaMLP",
        gelu_approximate="tanh",
        post_attention_norm=True,
        post_mlp_norm=True,
        scale_embeddings=True,
        attention_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window_size=4,
        sliding_window_indices=[1, 0],  # layer 0 sliding, layer 1 full
    )


@pytest.fixture(scope="module")
def models() -> dict[torch.dtype, torch.nn.Module]:
    """One seeded float32 model and its bf16 (run) and float64 (reference) copies."""
    torch.manual_seed(SEED)
    base = litgpt.GPT(_config())
    base.max_seq_length = L
    return {dtype: copy.deepcopy(base).to(dtype) for dtype in (torch.bfloat16, torch.float64)}


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return {"idx": torch.randint(0, 64, (B, L), generator=gen), "targets": torch.randint(0, 64, (B, L), generator=gen)}


def _step(model: torch.nn.Module, batch: dict, call: Callable | None = None) -> tuple:
    """One training step: cross-entropy (float32, float64 for the reference) and every parameter's gradient."""
    targets = batch["targets"]

    def loss(logits: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(logits.dtype, torch.float32)
        return F.cross_entropy(logits.to(acc).flatten(0, 1), targets.flatten())

    return _grads(model, {"idx": batch["idx"]}, loss, torch.ones(()), call=call)


def _jit(model: torch.nn.Module, transforms: list) -> Callable:
    return thunder.jit(model, executors=[tcs.emulated_ex, *thunder.get_default_executors()], transforms=transforms)


def _assert_accurate(ours: tuple, models: dict, batch: dict) -> None:
    """The loss and every parameter gradient by the accuracy rule: float64 eager as the reference, bf16 eager as
    the yardstick."""
    eager = _step(models[torch.bfloat16], batch)
    ref = _step(models[torch.float64], batch)
    names = ["loss"] + [f"gradient of {n}" for n, _ in models[torch.bfloat16].named_parameters()]
    for name, o, e, r in zip(names, (ours[0], *ours[1]), (eager[0], *eager[1]), (ref[0], *ref[1])):
        if r is not None:
            assert o is not None, f"{name}: no gradient"
            assert_close_to_reference(o, e, r, name)


def test_without_the_transform_the_scores_are_materialised(models, batch, fresh_cache):
    """The baseline: thunder alone runs the step accurately, nothing is claimed (LitGPT calls no F.sdpa) and every
    layer leaves its score tensors in the forward trace, so the fused test's checks have something to fail on."""
    model = models[torch.bfloat16]
    jm = _jit(model, [])
    ours = _step(model, batch, call=jm)
    counts = _count_trace_symbols([jm])
    assert counts.get(OUR_FWD, 0) == 0 and counts.get(OUR_BWD, 0) == 0, counts
    scores = score_tensors(thunder.last_traces(jm)[-1], B, N_HEAD, L, L)
    assert len(scores) >= N_LAYER, f"expected score tensors of every layer, found {[p.name for p in scores]}"
    _assert_accurate(ours, models, batch)


def test_every_layer_runs_fused(models, batch, fresh_cache):
    """With the transform: every attention layer recognised and claimed forward and backward, no score tensor left
    in the final forward trace, and the step as accurate as the rule asks."""
    tf = tcs.FuseHandwrittenAttention()
    model = models[torch.bfloat16]
    jm = _jit(model, [tf])
    with on_the_runtime():
        ours = _step(model, batch, call=jm)
    assert tf.recognised == N_LAYER, (tf.recognised, tf.declined)
    assert tf.declined == [], f"regions the transform declined: {tf.declined}"
    counts = _count_trace_symbols([jm])
    assert counts.get(OUR_FWD, 0) == N_LAYER, f"forward: {counts}"
    assert counts.get(OUR_BWD, 0) == N_LAYER, f"backward: {counts}"
    scores = score_tensors(thunder.last_traces(jm)[-1], B, N_HEAD, L, L)
    assert scores == [], f"score tensors left in the forward trace: {[p.name for p in scores]}"
    _assert_accurate(ours, models, batch)


def test_importing_litgpt_leaves_torch_compile_alone():
    """lightning.fabric's torch.compile wrapper deep-copies a ThunderCompiler backend (locks inside): with it,
    every ThunderFX test collected with this module failed. The import above undoes the wrapper."""
    assert torch.compile is _torch_compile and not hasattr(torch.compile, "__wrapped__")


#: bytes of (B, H, L, S) and (B, H, L, S + 1) tensors in the final forward trace of one training step at this
#: module's shape (B 2, H 4, L = S 12), without and with the transform: docs/results.md's "Score tensors per
#: training step" table records them
SCORE_BYTES = (147456, 0)


def test_score_tensor_bytes_per_step(models, batch, fresh_cache):
    """The numbers docs/results.md records: score-tensor bytes in the final forward trace before and after."""
    from checks import score_tensor_bytes

    found = []
    for transforms in ([], [tcs.FuseHandwrittenAttention()]):
        jm = _jit(models[torch.bfloat16], transforms)
        _step(models[torch.bfloat16], batch, call=jm)
        found.append(score_tensor_bytes(thunder.last_traces(jm)[-1], B, N_HEAD, L, L))
    print(f"LitGPT Gemma 2: score tensor bytes per step {found[0]} -> {found[1]}")
    assert found[0] > 0 and found[1] == 0, found
    if SCORE_BYTES[0] is not None:
        assert tuple(found) == SCORE_BYTES, f"docs/results.md records {SCORE_BYTES}, the traces hold {found}"
