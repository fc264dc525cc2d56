"""install()/uninstall() round-trip on thunder's default executor list."""

import thunder
import torch

import thunder_cudnn_safe as tcs


def names():
    return [ex.name for ex in thunder.get_default_executors()]


def test_install_uninstall_round_trip():
    original = list(thunder.get_default_executors())
    try:
        tcs.install()
        tcs.install()  # idempotent
        assert names()[0] == "cudnn_safe"
        assert "cudnn" not in names() and names().count("cudnn_safe") == 1
        assert tcs.installed()
        tcs.uninstall()
        tcs.uninstall()  # idempotent
        assert list(thunder.get_default_executors()) == original
        assert not tcs.installed()
    finally:
        thunder.extend.set_default_executors(original)


def test_install_emulated_makes_plain_jit_use_it(fresh_cache):
    original = list(thunder.get_default_executors())
    try:
        tcs.install(emulated=True)
        assert names()[:2] == ["cudnn_safe", "cudnn_safe_emulated"]
        q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16) for _ in range(3))
        jf = thunder.jit(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        jf(q, k, v)
        assert "cudnn_safe_emulated_sdpa_fwd" in str(thunder.last_traces(jf)[-1])
    finally:
        tcs.uninstall()
        thunder.extend.set_default_executors(original)


def test_builtin_restored_at_its_position():
    original = list(thunder.get_default_executors())
    builtin = thunder.extend.get_executor("cudnn")
    if builtin is None:
        return  # no built-in cuDNN executor on this machine: nothing to restore
    try:
        thunder.extend.set_default_executors([thunder.sdpa_executor, builtin])
        tcs.install()
        assert names() == ["cudnn_safe", "sdpa"]
        tcs.uninstall()
        assert names() == ["sdpa", "cudnn"]
    finally:
        thunder.extend.set_default_executors(original)
