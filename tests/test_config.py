"""thunder_cudnn_safe.config: every knob has a default, an environment variable with a parser that
warns on a typo, a setter and a scoped patch() (docs/design.md's "Removed in 0.1.0" lists the older
spellings; tests/test_public_api.py checks they are gone); clear_cache() clears every cache and says which."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import config
from thunder_cudnn_safe.graphs import build, plan_cache
from thunder_cudnn_safe.masks import bias, patterns
from thunder_cudnn_safe.runtimes import base, emulation

# knob -> (a valid environment text, the value it parses to, an invalid text, a valid Python value, an invalid one)
CASES = {
    "cache_size": ("7", 7, "zero", 5, 0),
    "mask_cache_size": ("0", 0, "-1", 3, -2),
    "mask_patterns": ("0", False, "no", False, "yes"),
    "dynamic_shapes": (" OFF ", "off", "sometimes", "forward", "always"),
    "dp_workspace_limit": ("1024", 1024, "lots", 0, -1),
    "plan_cache_dir": ("/tmp/plans", "/tmp/plans", None, "/tmp/other", 3),
    "plan_cache_max_entries": ("3", 3, "many", 5, 0),
    "plan_cache_max_bytes": ("4096", 4096, "1 GiB", 1 << 20, -1),
    "aot_timeout": ("90", 90.0, "soon", 0, -1),
    "emulated_arch": ("sm100", (10, 0), "foo", "8.6", (9,)),
    "emulated_backend": ("91000", 91000, "nine", 90500, 0),
    "layout": ("contiguous", "contiguous", "rowmajor", "contiguous", "strided"),
    "deterministic": ("1", True, "maybe", True, 1),
    "bwd_may_cat_grad_qkv": ("1", True, "2", True, "true"),
    "fuse_handwritten_attention": ("0", False, "off", False, "no"),
    "eager_runtime": (" Emulated", "emulated", "cudnn", "decomposition", "thunder"),
}


def test_every_knob_is_covered_and_documented():
    assert set(CASES) == set(config.KNOBS)
    for knob in config.KNOBS.values():
        assert knob.env.startswith("THUNDER_CUDNN_SAFE_") and knob.trades and knob.expected
        assert config.values()[knob.name] == getattr(config, knob.name)
    assert len({k.env for k in config.KNOBS.values()}) == len(config.KNOBS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_environment_parse_and_invalid_value_warns(name, monkeypatch, caplog):
    env_text, parsed, bad_text, _, _ = CASES[name]
    knob = config.KNOBS[name]
    monkeypatch.setenv(knob.env, env_text)
    assert config.from_environment(name) == parsed
    monkeypatch.delenv(knob.env)
    assert config.from_environment(name) == knob.default
    if bad_text is not None:
        monkeypatch.setenv(knob.env, bad_text)
        with caplog.at_level(logging.WARNING, logger="thunder_cudnn_safe"):
            assert config.from_environment(name) == knob.default
        assert any(knob.env in r.getMessage() and knob.expected in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_environment_accepts_no_value_the_setter_refuses(name):
    """An environment text parses to a value config.set would take too (THUNDER_CUDNN_SAFE_EMULATED_BACKEND=0
    was parsed by plain int, so the emulation ran with cuDNN "version 0", which config.set refuses)."""
    knob = config.KNOBS[name]
    for text in ("0", "-1", "-0.5", "1", "7", "0.5", "nan", "inf", "x", "sm90", "none", CASES[name][0]):
        try:
            parsed = knob.parse(text)
        except ValueError:
            continue
        assert knob.check(parsed) == parsed, (name, text)


@pytest.mark.parametrize("name", sorted(CASES))
def test_setter_validates_and_patch_restores(name):
    _, _, _, good, bad = CASES[name]
    before = getattr(config, name)
    with pytest.raises((ValueError, TypeError), match=f"config.{name} must be"):
        config.set(**{name: bad})
    assert getattr(config, name) == before
    with config.patch(**{name: good}):
        assert getattr(config, name) == config.KNOBS[name].check(good) != before or good == before
    assert getattr(config, name) == before
    with pytest.raises(RuntimeError, match="boom"), config.patch(**{name: good}):
        raise RuntimeError("boom")
    assert getattr(config, name) == before
    config.set(**{name: good})
    try:
        assert getattr(config, name) == config.KNOBS[name].check(good)
    finally:
        config.set(**{name: before})


def test_unknown_knob_and_patch_as_decorator():
    with pytest.raises(AttributeError, match="no knob"):
        config.set(cache_sise=3)

    @config.patch(mask_patterns=False)
    def inside():
        return config.mask_patterns

    assert inside() is False and config.mask_patterns is True


def test_knobs_reach_their_caches_and_runtimes():
    with config.patch(cache_size=3, mask_cache_size=2, emulated_arch="sm100", emulated_backend=90500):
        assert tcs.cache_info().maxsize == 3 and tcs.mask_cache_info().entries <= 2
        assert bias.converted_masks.maxsize == 2
        assert emulation.emulated_target().arch == (10, 0)
        assert emulation.emulated_target().backend_version == 90500
    assert tcs.cache_info().maxsize == config.cache_size and bias.converted_masks.maxsize == config.mask_cache_size
    assert emulation.emulated_target().arch == config.emulated_arch


def test_a_refused_value_keeps_the_old_one():
    """A hook that raises (a cache refusing its bound) leaves the knob as it was."""
    before = config.cache_size
    config.on_change("cache_size", _refuse_seven)
    try:
        with pytest.raises(ValueError, match="seven"):
            config.set(cache_size=7)
        assert config.cache_size == before and tcs.cache_info().maxsize == before
    finally:
        config._hooks["cache_size"].remove(_refuse_seven)


def _refuse_seven(value):
    if value == 7:
        raise ValueError("seven")


def test_plan_cache_folder_and_bounds_are_knobs(tmp_path):
    """The plan cache's folder and bounds are three knobs: a changed bound reaches the plan cache in use
    (without forgetting its counters), a changed folder makes a new one."""
    with config.patch(plan_cache_dir=tmp_path, plan_cache_max_entries=3):
        active = plan_cache.active()
        assert config.plan_cache_dir == str(tmp_path) and str(active.directory) == str(tmp_path)
        assert (active.max_entries, active.max_bytes) == (3, config.KNOBS["plan_cache_max_bytes"].default)
        active.put("e", b"x")
        config.set(plan_cache_max_bytes=4096, plan_cache_max_entries=2)
        assert plan_cache.active() is active and (active.max_entries, active.max_bytes) == (2, 4096)
        assert active.counts["stores"] == 1
        with config.patch(plan_cache_dir=tmp_path / "other"):
            assert plan_cache.active().max_entries == 2 and plan_cache.active() is not active
    assert plan_cache.active() is None and config.plan_cache_max_entries == 2048


def test_mask_patterns_knob_is_read_at_use_time():
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    tcs.clear_cache()
    assert patterns.pattern_of(mask, 1, 4, 4) is not None
    with config.patch(mask_patterns=False):
        tcs.clear_cache()
        assert patterns.pattern_of(mask, 1, 4, 4) is None


def test_compile_option_defaults_come_from_config():
    from thunder_cudnn_safe.integration import executor

    q = torch.empty(1, 2, 4, 8, dtype=torch.float16)
    assert executor._call(q, q, q).layout == "preserve"
    with config.patch(layout="contiguous", deterministic=True, bwd_may_cat_grad_qkv=True):
        call = executor._call(q, q, q)
        assert (call.layout, call.deterministic, call.cat_grad_qkv) == ("contiguous", True, True)
    call = executor._call(q, q, q)
    assert (call.layout, call.deterministic, call.cat_grad_qkv) == ("preserve", False, False)


@pytest.mark.environments  # a child interpreter imports torch, thunder and the package (seconds): that tier
def test_environment_reaches_the_package_at_import():
    code = "import thunder_cudnn_safe as t; print(t.config.values())"
    env = {
        **os.environ,
        "THUNDER_CUDNN_SAFE_LAYOUT": "contiguous",
        "THUNDER_CUDNN_SAFE_MASK_PATTERNS": "0",
        "THUNDER_CUDNN_SAFE_DYNAMIC_SHAPES": " OFF ",
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "'layout': 'contiguous'" in proc.stdout and "'mask_patterns': False" in proc.stdout
    assert "'dynamic_shapes': 'off'" in proc.stdout


def test_clear_cache_clears_every_cache_and_says_which(caplog):
    disp = tcs.emulated_ex.dispatcher
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    disp.forward(q, q, q, mask, 0.0, False)
    base._static_only.put(("topology",), True)
    build._kernel_caches[("scope",)] = object()
    tcs.telemetry.warn_once(("fallback", "x"), "a fallback")
    assert len(tcs.cached_graphs()) and len(disp.memos) and len(bias.converted_masks._lru)
    with caplog.at_level(logging.INFO, logger="thunder_cudnn_safe"):
        names = tcs.clear_cache()
    assert names == tcs.caches.registered() and len(names) == 11  # one registry: each cache registers itself
    assert "the checkers' key-gate verdicts by call signature" in names
    assert "sink tokens of attention sinks" in names
    assert "clear_cache cleared" in caplog.text
    assert tcs.cached_graphs() == [] and tcs.cache_info().misses == 0
    assert len(disp.memos) == 0 and len(bias.converted_masks._lru) == 0
    assert ("topology",) not in base._static_only and build._kernel_caches == {}
    assert ("fallback", "x") not in tcs.telemetry._warned


def test_patch_without_knobs_restores_every_knob_set_inside():
    before = {name: getattr(config, name) for name in config.KNOBS}
    with config.patch():
        config.set(dp_workspace_limit=12, mask_patterns=False)
        assert config.dp_workspace_limit == 12
    assert {name: getattr(config, name) for name in config.KNOBS} == before


def test_aot_children_have_a_default_timeout(monkeypatch):
    """aot.compile_in_subprocess ran its children with no timeout unless asked: a hung NVRTC or driver
    stand-in hung the caller. Now config.aot_timeout (20 minutes) applies; 0 means no limit."""
    from thunder_cudnn_safe.runtimes import aot

    seen = []

    def run(*args, **kwargs):
        seen.append(kwargs["timeout"])
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"] or 0)

    monkeypatch.setattr(aot.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="aot_timeout"):
        aot.compile_in_subprocess([], "H100")
    with config.patch(aot_timeout=7), pytest.raises(RuntimeError, match="7 s limit"):
        aot.compile_in_subprocess([], "H100")
    with config.patch(aot_timeout=0), pytest.raises(RuntimeError):
        aot.compile_in_subprocess([], "H100")
    with pytest.raises(RuntimeError):
        aot.compile_in_subprocess([], "H100", timeout=3)
    assert seen == [1200.0, 7.0, None, 3.0]


def test_an_aot_child_past_its_limit_is_killed():
    """A real child (it cannot even import torch in 0.2 s) is killed and the call raises, naming the knob."""
    from thunder_cudnn_safe.runtimes import aot

    with config.patch(aot_timeout=0.2), pytest.raises(RuntimeError, match="THUNDER_CUDNN_SAFE_AOT_TIMEOUT"):
        aot.compile_in_subprocess([], "H100")
