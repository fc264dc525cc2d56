"""Padding-free (packed) training steps of tiny HF models under ThunderFX (issue 30): transformers 5
builds a block-diagonal document mask from ``position_ids`` restarting per document (no attention
mask, no cache); the executor runs it as cuDNN variable-length attention, never as a bias, and the
output and every gradient stay within the accuracy rule against float64 eager."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_case
from zoo import ModelCase, _hidden, _ids, _llm

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch import packed

pytest.importorskip("transformers")

pytestmark = pytest.mark.models

#: two rows of 16 tokens: documents 5+3+8 and 10+6
DOCUMENTS = [[5, 3, 8], [10, 6]]


def _packed_inputs(dtype, gen):
    pos = torch.tensor([[p for n in row for p in range(n)] for row in DOCUMENTS])
    return {"input_ids": _ids((2, 16), 128, gen), "position_ids": pos}


MODELS = {
    "llama": (_llm("Llama"), "documents+causal"),
    "mistral": (_llm("Mistral", sliding_window=4), "documents+causal+window"),
    "qwen2": (_llm("Qwen2"), "documents+causal"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_training_step_runs_varlen_without_a_bias(name, figure):
    build, pattern = MODELS[name]
    packed.reset_varlen_info()
    case = ModelCase(f"{name}_packed", build, _packed_inputs, _hidden, note="padding-free packing")
    rec = run_case(case, torch.bfloat16, "thunderfx", compare_default=False)
    figure(
        f"packed {name}: {rec.get('mask_patterns')}, varlen {packed.varlen_info()}, "
        f"copies {rec.get('copies_by_reason')}"
    )
    assert rec["status"] == "pass", json.dumps(rec, indent=1, default=str)
    assert rec["sdpa_claimed"] > 0 and rec["fallbacks"] == 0
    assert rec["bias_graphs"] == 0, rec
    assert set(rec["mask_patterns"]) == {pattern}, rec["mask_patterns"]
    ragged = [g.key for g in tcs.cached_graphs() if g.key.ragged is not None]
    assert ragged and len(ragged) == len(tcs.cached_graphs()), tcs.cached_graphs()
    info = packed.varlen_info()
    assert info.get("forward", 0) > 0 and info.get("backward", 0) > 0, info


def test_packed_gqa_step_with_repeat_kv_rewritten_runs_varlen_on_the_kv_heads(figure):
    """Tiny Llama (4 query heads, 2 K/V heads) packed, under ThunderFX with RepeatKVToGQA: the document
    calls run as variable-length GQA on the 2 K/V heads (no repeat materialized, no bias graph), and the
    output and every gradient stay within the accuracy rule."""
    build, pattern = MODELS["llama"]
    packed.reset_varlen_info()
    case = ModelCase("llama_packed_gqa", build, _packed_inputs, _hidden, note="padding-free packing, RepeatKVToGQA")
    rec = run_case(case, torch.bfloat16, "thunderfx_gqa", compare_default=False)
    figure(f"packed llama (RepeatKVToGQA): varlen {packed.varlen_info()}, copies {rec.get('copies_by_reason')}")
    assert rec["status"] == "pass", json.dumps(rec, indent=1, default=str)
    assert rec["sdpa_claimed"] > 0 and rec["fallbacks"] == 0 and rec["bias_graphs"] == 0, rec
    assert set(rec["mask_patterns"]) == {pattern}, rec["mask_patterns"]
    graphs = tcs.cached_graphs()
    assert graphs and all(g.key.ragged is not None for g in graphs), graphs
    heads = {(g.key.q.shape[1], g.key.k.shape[1]) for g in graphs}
    assert heads == {(4, 2)}, heads
    info = packed.varlen_info()
    assert info.get("forward", 0) > 0 and info.get("backward", 0) > 0, info
