"""README's code runs as written: every ```python block of README.md is either run here on a CPU, with the
tiny model and tensors this file defines, and checked for what README says it does, or listed in NOT_RUN with
why. A block in neither list fails the test until it is classified (the usage line
``thunder_cudnn_safe.integration.install()`` raised ``TypeError: 'module' object is not callable``, found as a
new user would find it)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import thunder
import thunder.extend
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: README's ```python blocks, in order
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def _key(block: str) -> str:
    """A block's name here: its first line of code, without a trailing comment."""
    first = next(line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    return first.split("  #")[0].strip()


class Attention(torch.nn.Module):
    """The ``model`` README's blocks jit: causal attention over the q, k, v it is given."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _namespace() -> dict:
    """What a reader has in hand when a block runs: the imports of README's first block, a model, q/k/v."""
    seeds = (torch.Generator().manual_seed(i) for i in range(3))
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float16, generator=seed) for seed in seeds)
    return {"thunder": thunder, "thunder_cudnn_safe": tcs, "model": Attention(), "q": q, "k": k, "v": v}


def _run(block: str, ns: dict) -> list:
    """Run the block statement by statement; returns the value of each (None for a statement that is not an
    expression), so a check can see what an expression such as ``explain(...)`` returned."""
    values = []
    for statement in ast.parse(block).body:
        if isinstance(statement, ast.Expr):
            values.append(eval(compile(ast.Expression(statement.value), "README.md", "eval"), ns))
        else:
            exec(compile(ast.Module([statement], []), "README.md", "exec"), ns)
            values.append(None)
    return values


def _runs_like_eager(ns: dict, name: str) -> thunder.core.trace.TraceCtx:
    """The jitted model the block made computes attention within the accuracy rule; returns its last trace."""
    jitted, model, q, k, v = ns[name], ns["model"], ns["q"], ns["k"], ns["v"]
    eager, reference = model(q, k, v), model(q.double(), k.double(), v.double())
    assert_close_to_reference(jitted(q, k, v), eager, reference, f"README's {name}(q, k, v)")
    return thunder.last_traces(jitted)[-1]


def _executors_listed(block: str, ns: dict) -> None:
    _run(block, ns)
    assert tcs.cudnn_safe_ex in thunder.compile_data(ns["jmodel"]).executors_list
    _runs_like_eager(ns, "jmodel")  # on a CPU cudnn_safe_ex declines and the next executor runs the call


def _install_then_uninstall(block: str, ns: dict) -> None:
    defaults = thunder.get_default_executors()
    states = []
    try:
        for statement in ast.parse(block).body:
            exec(compile(ast.Module([statement], []), "README.md", "exec"), ns)
            states.append(tcs.installed())
        assert states == [True, False]
        assert thunder.get_default_executors() == defaults
    finally:  # a failed block leaves thunder's defaults as other tests expect them
        thunder.extend.set_default_executors(defaults)


def _explains(block: str, ns: dict) -> None:
    (reasons,) = _run(block, ns)
    assert reasons and all(isinstance(reason, tcs.Decline) for reason in reasons)  # CPU tensors: declined
    assert any(reason.code is tcs.DeclineCode.DEVICE for reason in reasons), reasons


def _emulated(block: str, ns: dict) -> None:
    _run(block, ns)
    trace = _runs_like_eager(ns, "jm")
    assert "cudnn_safe_emulated_sdpa_fwd(" in str(trace)  # the emulated executor claimed the CPU call


def _fuses(block: str, ns: dict) -> None:
    _run(block, ns)
    fuse, q, k, v = ns["fuse"], ns["q"], ns["k"], ns["v"]
    assert fuse.recognised == 1 and fuse.declined == []
    trace = thunder.last_traces(ns["jf"])[-1]
    assert "cudnn_safe_emulated_sdpa_fwd(" in str(trace) and "tanh" not in str(trace)  # one fused call, no softcap ops
    args = (q, k, v, torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16))
    eager, reference = ns["gemma2_attention"](*args), ns["gemma2_attention"](*(t.double() for t in args))
    assert_close_to_reference(ns["out"], eager, reference, "README's fused Gemma-2 attention")


#: README's blocks run here, by key, each with what it must do once run
RUN: dict[str, Callable[[str, dict], None]] = {
    "import thunder, thunder_cudnn_safe": _executors_listed,
    "thunder_cudnn_safe.install()": _install_then_uninstall,
    "thunder_cudnn_safe.explain(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)": _explains,
    "jm = thunder.jit(model, executors=[thunder_cudnn_safe.emulated_ex, *thunder.get_default_executors()])": _emulated,
    "import torch, thunder, thunder_cudnn_safe as tcs": _fuses,
}
#: README's blocks not run here, by key, each with why
NOT_RUN: dict[str, str] = {
    "ids, pos, labels = (tcs.shard_sequence(x, group, dim=1) for x in (ids, pos, labels))": (
        "needs a process group of several ranks (torchrun): tests/test_context_parallel.py runs tiny HF Llama and "
        "gpt-oss this way on two gloo ranks (distributed tier)"
    ),
    "fn = torch.compile(lambda q, k, v, s: tcs.attention(q, k, v, is_causal=True, sinks=s), fullgraph=True)": (
        "an inductor compile (tens of seconds): tests/test_attention_op.py's torch.compile tests (slow tier) run "
        "this call, forward and backward, through the emulated executor with config.eager_runtime='emulated'"
    ),
}


def test_every_python_block_is_classified():
    keys = [_key(block) for block in BLOCKS]
    assert keys, "README has no python block"
    unclassified = [key for key in keys if key not in RUN and key not in NOT_RUN]
    assert unclassified == [], f"README blocks neither run nor listed with a reason in NOT_RUN: {unclassified}"
    stale = [key for key in (*RUN, *NOT_RUN) if key not in keys]
    assert stale == [], f"classified blocks README no longer has: {stale}"
    assert not set(RUN) & set(NOT_RUN)


@pytest.mark.parametrize("block", [b for b in BLOCKS if _key(b) in RUN], ids=_key)
def test_readme_block_runs(block):
    RUN[_key(block)](block, _namespace())


def test_set_up_commands_are_what_ci_runs():
    """README's install lines (the ``pip install`` lines of its ```bash blocks, the optional LitGPT line included)
    are lines of ``.ci/run``, as written there (a trailing ``|| exit 1`` aside): README and CI cannot drift apart."""
    installs = [
        line.strip()
        for block in re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)
        for line in block.splitlines()
        if "pip install" in line
    ]
    assert len(installs) >= 2, installs
    ci = {line.strip().removesuffix("|| exit 1").strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    assert [line for line in installs if line not in ci] == []
