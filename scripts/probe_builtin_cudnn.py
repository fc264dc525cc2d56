#!/usr/bin/env python3
"""Record what thunder's built-in cuDNN executor does with this nvidia-cudnn-frontend.

Run by scripts/gpu_check.sh on the GPU machine (also runs, less informatively, on CPU).
It imports thunder alone (not thunder_cudnn_safe), then runs the diffusers-style SDPA
call (B=2, S=64, H=8, D=96, q/k/v BSHD storage viewed as BHSD through transpose(1, 2),
grad_out transposed likewise) forward and backward through

* ``thunder.jit(fn, executors=[cudnn_ex])``: the built-in executor alone, and
* ``thunder.jit(fn)``: plain defaults, in which the built-in executor comes first,

in float16 and bfloat16. With frontend >= 1.27 the built-in executor's graph builders
call ``pygraph.scaled_dot_product_flash_attention``, which no longer exists, so the
expected outcome is an AttributeError from its checker; whatever happens is recorded.
A call that runs is compared to float64 eager (max abs error of out, dq, dk, dv).

    python3 scripts/probe_builtin_cudnn.py [--json PATH]

Always exits 0 unless the probe itself breaks: the outcome is data, not a verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback


def _exc(exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    where = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:]]
    return {"outcome": "error", "type": type(exc).__name__, "message": str(exc)[:500], "where": where}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the record here too")
    args = parser.parse_args(argv)

    record: dict = {"python": sys.version.split()[0]}
    import torch

    record["torch"] = torch.__version__
    record["cuda_available"] = torch.cuda.is_available()
    try:
        import cudnn

        record["frontend"] = getattr(cudnn, "__version__", None)
        record["pygraph_has_scaled_dot_product_flash_attention"] = hasattr(
            cudnn.pygraph, "scaled_dot_product_flash_attention"
        )
        record["pygraph_has_sdpa"] = hasattr(cudnn.pygraph, "sdpa")
        try:
            record["backend"] = int(cudnn.backend_version())
        except Exception as exc:  # libcudnn not loadable
            record["backend"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        record["frontend"] = f"not importable: {type(exc).__name__}: {exc}"

    try:
        import thunder
        from thunder.extend import get_executor
    except Exception as exc:
        record["thunder_import"] = _exc(exc)
        return _finish(record, args.json)
    record["thunder"] = thunder.__version__
    builtin = get_executor("cudnn")
    record["builtin_registered"] = builtin is not None
    record["default_executors"] = [ex.name for ex in thunder.get_default_executors()]
    if builtin is None or not torch.cuda.is_available():
        record["runs"] = "skipped: " + ("no built-in cudnn executor" if builtin is None else "no CUDA")
        return _finish(record, args.json)

    import torch.nn.functional as F

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    runs = {}
    b, s, h, d = 2, 64, 8, 96
    for dtype in (torch.float16, torch.bfloat16):
        gen = torch.Generator(device="cuda").manual_seed(0)
        qkv = [torch.randn(b, s, h, d, dtype=dtype, device="cuda", generator=gen) for _ in range(3)]
        grad_out = torch.randn(b, s, h, d, dtype=dtype, device="cuda", generator=gen).transpose(1, 2)
        ref_in = [t.double().transpose(1, 2).requires_grad_() for t in qkv]
        ref = fn(*ref_in)
        ref_grads = torch.autograd.grad(ref, ref_in, grad_out.double())
        for label, executors in (("builtin_only", [builtin]), ("plain_defaults", None)):
            name = f"{label}/{str(dtype).removeprefix('torch.')}"
            q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in qkv)
            try:
                jf = thunder.jit(fn, executors=executors) if executors else thunder.jit(fn)
                out = jf(q, k, v)
                grads = torch.autograd.grad(out, (q, k, v), grad_out)
                torch.cuda.synchronize()
                fwd = str(thunder.last_traces(jf)[-1])
                errs = {
                    n: float((a.double() - r).abs().max())
                    for n, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))
                }
                runs[name] = {
                    "outcome": "ran",
                    "claimed_by_builtin": "cudnn_sdpa_fwd" in fwd,
                    "max_abs_error_vs_float64": errs,
                }
            except Exception as exc:
                runs[name] = _exc(exc)
    record["runs"] = runs
    return _finish(record, args.json)


def _finish(record: dict, path: str | None) -> int:
    text = json.dumps(record, indent=2, default=str)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
