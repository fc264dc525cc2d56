"""Tiny HF models under ThunderFX run their masks as cuDNN's own masking (issue 21): no forward or
backward graph declares a bias, and output and every gradient stay within the accuracy rule."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_case
from zoo import CASES

pytest.importorskip("transformers")

pytestmark = pytest.mark.models

#: model -> the patterns its masks must be recognized as
EXPECTED = {
    "llama": {"causal"},
    "mistral": {"causal+window"},
    "llama_right_padding": {"causal+padding"},
    "bert": {"padding"},
    "vit": set(),  # no mask at all, or an all-True one
    "clip": {"causal", "causal+padding", "padding"},
    "whisper": {"causal"},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_model_masks_run_without_a_bias(name, figure):
    rec = run_case(CASES[name], torch.bfloat16, "thunderfx", compare_default=False)
    figure(f"patterns {name}: {rec.get('mask_patterns')}, bias graphs {rec.get('bias_graphs')}, status {rec['status']}")
    assert rec["status"] == "pass", json.dumps(rec, indent=1, default=str)
    assert rec["sdpa_claimed"] > 0 and rec["fallbacks"] == 0
    assert rec["bias_graphs"] == 0, rec
    seen = {p for p in rec["mask_patterns"] if p != "all_kept"}
    assert "bias" not in seen and seen <= EXPECTED[name], rec["mask_patterns"]
