"""scripts/models_table.py: the README table generated from the suite's JSON records."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "models_table.py"


def _load():
    spec = importlib.util.spec_from_file_location("models_table", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(model, frontend, dtype, status, **kw):
    base = {
        "model": model,
        "frontend": frontend,
        "dtype": dtype,
        "status": status,
        "note": f"{model} note",
        "sdpa_claimed": 2,
        "sdpa_total": 2,
        "decline_reasons": {},
        "copies_per_step": 0,
        "bytes_per_step": 0,
        "copies_by_reason": {},
        "mask_conversions_per_step": 0,
        "backward_executions_per_step": 2,
        "builds": 2,
        "fallbacks": 0,
        "worst_ratio": 0.5,
    }
    base.update(kw)
    return base


def test_one_row_per_model_figures_from_thunderfx_bf16(tmp_path, capsys):
    records = [
        _rec("llama", "thunderfx", "float16", "pass", worst_ratio=0.25, builds=99),
        _rec(
            "llama",
            "thunderfx",
            "bfloat16",
            "pass",
            copies_per_step=4,
            bytes_per_step=4096,
            copies_by_reason={"attn_mask: boolean mask converted to an additive bias": [4, 4096]},
            mask_conversions_per_step=4,
        ),
        _rec("llama", "jit", "bfloat16", "thunder limitation", error="NotImplementedError: something"),
        _rec(
            "gpt2_hd12",
            "thunderfx",
            "bfloat16",
            "pass",
            sdpa_claimed=0,
            decline_reasons={"head dim 12 is not a multiple of 8": 2},
        ),
        _rec("bad", "thunderfx", "bfloat16", "FAIL"),
    ]
    path = tmp_path / "models.json"
    path.write_text(json.dumps(records))
    assert _load().main([str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| model |") and "ThunderFX fp16" in lines[0] and "thunder.jit bf16" in lines[0]
    assert "thunder.jit fp16" not in lines[0]  # no record has it
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]}
    assert set(rows) == {"llama", "gpt2_hd12", "bad"}
    llama = rows["llama"]
    assert llama[2] == "2 / 2"
    assert llama[3] == "4 (4.0 KiB): 4x attn_mask: boolean mask converted to an additive bias"
    assert llama[4] == "4" and llama[6] == "2"  # from the bf16 ThunderFX record, not the fp16 one (99 builds)
    assert llama[8:] == [
        "pass (0.25)",
        "pass (0.50)",
        "thunder limitation (fails without this executor too): `NotImplementedError: something`",
    ]
    assert "declined: head dim 12 is not a multiple of 8" in rows["gpt2_hd12"][2]
    assert rows["bad"][9] == "**FAIL**"
