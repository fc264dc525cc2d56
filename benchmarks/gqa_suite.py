"""GQA memory: what repeating K/V costs per forward+backward, with and without ``RepeatKVToGQA``.

transformers' ``repeat_kv`` (the path Hugging Face models take under ThunderFX) feeding
``F.scaled_dot_product_attention`` runs through ``thunder.jit`` with the emulated executor first
(CPU; the emulated runtime executes the same bound graphs the cuDNN runtime would), once as it is
and once with ``transforms=[RepeatKVToGQA()]``. For each, one forward+backward, then:

* ``copy_stats``: bytes our executor copied (``thunder_cudnn_safe.copy_stats()``);
* ``repeat``: bytes of K/V materialized by the repeat before our operator (K/V arguments of our
  forward operator that are not the function's inputs: the reshape of repeat_kv's expand);
* ``saved``: bytes saved for backward, read from thunder: the tensors of the forward trace's
  return value (its second output, ``saved_for_backward``), numel x element size;
* ``dkv``: bytes of the dK/dV our backward operator writes (H_q heads, then reduced over the
  groups by the repeat's backward, or H_kv heads).

All are exact byte counts, linear in B x S (see :func:`formulas`), so small B/S on a CPU give the
same ratios as the 8B-class shapes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

METHOD = (
    "transformers' repeat_kv (expand + reshape) feeding F.scaled_dot_product_attention(is_causal=True), through "
    "thunder.jit(executors=[emulated_ex, *defaults]) on CPU, without and with transforms=[RepeatKVToGQA()]; one "
    "forward+backward. copy_stats: thunder_cudnn_safe.copy_stats().bytes_copied. repeat: numel x element size of our "
    "forward operator's K/V arguments that are produced inside the trace (the repeat's output). saved: numel x element "
    "size of every tensor in the final forward trace's saved_for_backward (its return's second element). dK/dV: our "
    "backward operator's dK/dV outputs. All counts are exact and linear in B x S."
)

FWD_OP, BWD_OP = "cudnn_safe_emulated_sdpa_fwd", "cudnn_safe_emulated_sdpa_bwd"


@dataclass(frozen=True)
class Case:
    b: int
    s: int
    hq: int
    hkv: int
    d: int
    dtype: str = "bfloat16"

    def label(self) -> str:
        return f"B={self.b} S={self.s} H_q={self.hq} H_kv={self.hkv} D={self.d} {self.dtype}"


CASES = (
    Case(1, 128, 32, 8, 128),
    Case(1, 256, 32, 8, 128),  # twice S: every count doubles (linearity check)
    Case(1, 128, 32, 4, 128),
    Case(1, 128, 16, 2, 128),
)
QUICK_CASES = (CASES[0], CASES[2])


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv (models/llama/modeling_llama.py)."""
    batch, heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(batch, heads, n_rep, slen, head_dim)
    return x.reshape(batch, heads * n_rep, slen, head_dim)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), is_causal=True)


def _nbytes(t) -> int:
    n = 1
    for s in t.shape:
        n *= int(s)
    return n * torch.empty((), dtype=_torch_dtype(t.dtype)).element_size()


def _torch_dtype(dtype) -> torch.dtype:
    from thunder.core.dtypes import to_torch_dtype

    return dtype if isinstance(dtype, torch.dtype) else to_torch_dtype(dtype)


def measure(case: Case, transform: bool) -> dict[str, Any]:
    """One forward+backward of :func:`attention` through thunder.jit; the byte counts."""
    import thunder
    from thunder.core.proxies import TensorProxy

    import thunder_cudnn_safe as tcs

    dtype = getattr(torch, case.dtype)
    q = torch.randn(case.b, case.hq, case.s, case.d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(case.b, case.hkv, case.s, case.d, dtype=dtype, requires_grad=True) for _ in range(2))
    options = {"transforms": [tcs.RepeatKVToGQA()]} if transform else {}
    jf = thunder.jit(attention, executors=[tcs.emulated_ex, *thunder.get_default_executors()], **options)
    tcs.reset_copy_stats()
    out = jf(q, k, v)
    out.backward(torch.randn_like(out))
    copied = tcs.copy_stats().bytes_copied

    fwd = thunder.last_traces(jf)[-1]
    bwd = thunder.last_backward_traces(jf)[-1]
    (call,) = [b for b in fwd.bound_symbols if b.sym.name == FWD_OP]
    (bcall,) = [b for b in bwd.bound_symbols if b.sym.name == BWD_OP]
    inputs = {a.name for a in fwd.args if isinstance(a, TensorProxy)}
    repeat = sum(_nbytes(t) for t in call.args[1:3] if t.name not in inputs)
    ret = [b for b in fwd.bound_symbols if b.sym.id == thunder.core.prims.PrimIDs.RETURN][-1]
    saved_for_backward = ret.args[1] if len(ret.args) == 2 else ret.args[0][1]  # return (fw_out, saved)
    saved = [t for t in thunder.core.pytree.tree_flatten(saved_for_backward)[0] if isinstance(t, TensorProxy)]
    saved_bytes = sum(_nbytes(t) for t in saved)
    saved_not_inputs = sum(_nbytes(t) for t in saved if t.name not in inputs)
    dkv = sum(_nbytes(t) for t in bcall.output[1:3])
    return {
        **asdict(case),
        "transform": transform,
        "copy_stats_bytes": copied,
        "repeat_bytes": repeat,
        "saved_bytes": saved_bytes,
        "saved_bytes_not_inputs": saved_not_inputs,
        "dkv_bytes": dkv,
        "kv_heads_at_op": int(call.args[1].shape[1]),
        "saved": [f"{t.name}{list(t.shape)}" for t in saved],
    }


def formulas(case: Case) -> dict[str, int]:
    """The counts predicted from the shapes (e: element size; T_q = B*H_q*S*D*e, T_kv = B*H_kv*S*D*e).

    without the transform: repeat = 2 T_q, saved = q + 2 repeated K/V + out + stats = 4 T_q + 4*B*H_q*S,
    dK/dV = 2 T_q; with it: repeat = 0, saved = 2 T_q + 2 T_kv + 4*B*H_q*S, dK/dV = 2 T_kv.
    """
    e = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
    tq = case.b * case.hq * case.s * case.d * e
    tkv = case.b * case.hkv * case.s * case.d * e
    stats = case.b * case.hq * case.s * 4
    return {
        "repeat_without": 2 * tq,
        "repeat_with": 0,
        "saved_without": 4 * tq + stats,
        "saved_with": 2 * tq + 2 * tkv + stats,
        "dkv_without": 2 * tq,
        "dkv_with": 2 * tkv,
    }


def run(*, quick: bool = False, log=print) -> dict[str, Any]:
    started = time.perf_counter()
    rows = []
    for case in QUICK_CASES if quick else CASES:
        predicted = formulas(case)
        for transform in (False, True):
            row = measure(case, transform)
            tag = "with" if transform else "without"
            row["matches_formula"] = all(
                row[f"{what}_bytes"] == predicted[f"{what}_{tag}"] for what in ("repeat", "saved", "dkv")
            )
            rows.append(row)
            log(
                f"gqa: {case.label()} transform={transform}: repeat {row['repeat_bytes']} B, saved "
                f"{row['saved_bytes']} B, dK/dV {row['dkv_bytes']} B, copy_stats {row['copy_stats_bytes']} B"
            )
    return {"method": METHOD, "formulas": formulas.__doc__, "seconds": time.perf_counter() - started, "cases": rows}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n else "0"


def markdown(suite: dict[str, Any]) -> str:
    parts = [
        "## GQA memory (repeat_kv vs RepeatKVToGQA)",
        "",
        f"Method: {suite['method']}",
        "",
        "| shape | RepeatKVToGQA | K/V heads at our op | copy_stats | K/V repeat materialized | saved for backward "
        "(of which not inputs) | dK/dV written | = formula |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in suite["cases"]:
        case = Case(r["b"], r["s"], r["hq"], r["hkv"], r["d"], r["dtype"])
        parts.append(
            f"| {case.label()} | {'on' if r['transform'] else 'off'} | {r['kv_heads_at_op']} | "
            f"{_mib(r['copy_stats_bytes'])} "
            f"| {_mib(r['repeat_bytes'])} | {_mib(r['saved_bytes'])} ({_mib(r['saved_bytes_not_inputs'])}) "
            f"| {_mib(r['dkv_bytes'])} | {'yes' if r['matches_formula'] else '**no**'} |"
        )
    parts += [
        "",
        "Formulas (e = element size, T_q = B*H_q*S*D*e, T_kv = B*H_kv*S*D*e): "
        + " ".join(line.strip() for line in suite["formulas"].split("\n")[2:] if line.strip()),
    ]
    return "\n".join(parts)


def plot(suite: dict[str, Any], path) -> str | None:
    return None
