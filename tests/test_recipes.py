"""A pack recipe prints the straight-line function it binds with (issue 31), and that text is the one it runs."""

from __future__ import annotations

import inspect
import re
import traceback

import torch

from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.layouts.keys import Uid
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall, memo_key, signature
from thunder_cudnn_safe.routing.recipes import PackRecipe, backward_recipe, bind, forward_recipe
from thunder_cudnn_safe.runtimes import emulation


def _forward() -> tuple[ForwardCall, PackRecipe]:
    q = torch.randn(2, 8, 4, 16).transpose(1, 2)  # BSHD viewed BHSD: bound as it is
    k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    call = ForwardCall(q, k, v, torch.ones(8, 8, dtype=torch.bool).tril())  # a boolean mask: one copy
    return call, forward_recipe(signature(call), emulation.emulated_target())


def _bound_uids(source: str) -> set[Uid]:
    return {Uid[name] for name in re.findall(r"# u\d+ = Uid\.(\w+)", source)}


def test_forward_recipe_prints_its_source():
    call, recipe = _forward()
    text = str(recipe)
    assert text == recipe.describe() and recipe.source in text and text.startswith("# ForwardKey recipe")
    compile(recipe.source, "<test>", "exec")  # the printed text is valid Python
    bound = bind(recipe, call)
    assert _bound_uids(recipe.source) == set(bound.pack) == {Uid.Q, Uid.K, Uid.V, Uid.BIAS, Uid.O, Uid.STATS}
    assert "BOOL_MASK" in recipe.source and "empty_strided" in recipe.source


def test_printed_source_is_the_function_that_runs():
    """Executing the printed source in the recipe's own names gives the same pack as ``recipe.run``."""
    call, recipe = _forward()
    env = dict(recipe.run.__globals__)
    exec(compile(recipe.source, "<test>", "exec"), env)
    again, ran = env["bind"](call, call.query.device), recipe.run(call, call.query.device)
    assert again.key == ran.key and set(again.pack) == set(ran.pack)
    for uid, t in ran.pack.items():
        assert (again.pack[uid].shape, again.pack[uid].stride()) == (t.shape, t.stride())
    for uid in (Uid.Q, Uid.K, Uid.V, Uid.BIAS):  # the rest are fresh, unwritten outputs
        assert torch.equal(again.pack[uid], ran.pack[uid])
    assert again.pack[Uid.Q].data_ptr() == call.query.data_ptr()  # bound as it is, no copy


def test_backward_recipe_names_every_uid_it_binds():
    call, frecipe = _forward()
    o, stats = bind(frecipe, call).outputs
    g = torch.randn(o.shape).transpose(1, 2).contiguous().transpose(1, 2)
    seed = offset = torch.zeros((1, 1, 1, 1), dtype=torch.int64)
    bcall = BackwardCall(g, call.query, call.key, call.value, None, 0.0, True, o, stats, seed, offset)
    recipe = backward_recipe(signature(bcall), emulation.emulated_target())
    assert str(recipe).startswith("# BackwardKey recipe")
    compile(recipe.source, "<test>", "exec")
    assert _bound_uids(recipe.source) == set(bind(recipe, bcall).pack)
    assert {Uid.DO, Uid.DQ, Uid.DK, Uid.DV} <= _bound_uids(recipe.source)


def _raised_in(fn, *args) -> str:
    """The formatted traceback of ``fn(*args)``, which must raise."""
    try:
        fn(*args)
    except Exception:
        return traceback.format_exc()
    raise AssertionError(f"{fn} did not raise")


def test_a_traceback_through_generated_code_shows_its_lines():
    """Issue 41 item 4: each generated function (a recipe's binder, a memo key, a dispatcher entry point) has its
    own filename with its source in linecache, so a traceback through it shows the line that raised."""
    call, recipe = _forward()
    text = _raised_in(recipe.run, call[:2], call.query.device)  # too few values to unpack: the binder's first line
    assert recipe.source.splitlines()[1].strip() in text and "ForwardKey recipe #" in text

    memo = memo_key.__globals__["_MEMOS"][ForwardCall]
    text = _raised_in(memo, call._replace(query=None), emulation.emulated_target())
    assert "return (target, config.dynamic_shapes, c.query.shape" in text and "memo key of ForwardCall #" in text

    disp = Dispatcher(emulation.EmulatedRuntime())
    text = _raised_in(disp.forward, None, call.key, call.value)
    assert "    device = query.device" in text and "Dispatcher.forward #" in text
    assert inspect.getsource(disp.backward).startswith("def backward(self, grad_out")  # pdb's `list` reads the same

    _, other = _forward()
    assert other.run.__code__.co_filename != recipe.run.__code__.co_filename  # one filename per generated function


def _backward_call() -> BackwardCall:
    call, frecipe = _forward()
    o, stats = bind(frecipe, call).outputs
    g = torch.randn(o.shape).transpose(1, 2).contiguous().transpose(1, 2)  # dO in another layout than O
    seed = offset = torch.zeros((1, 1, 1, 1), dtype=torch.int64)
    return BackwardCall(g, call.query, call.key, call.value, call.attn_mask, 0.0, False, o, stats, seed, offset)


def test_a_key_is_planned_without_compiling_a_binder(monkeypatch):
    """``forward_key`` / ``backward_key`` (what ``explain()`` and the checkers plan) declare the recipe's very key
    and compile nothing; only a recipe, which binds, compiles its binder."""
    from thunder_cudnn_safe.routing import recipes

    compiled = []
    real = recipes.compile_function
    monkeypatch.setattr(recipes, "compile_function", lambda *a: compiled.append(a[-1]) or real(*a))
    target = emulation.emulated_target()
    call, bcall = signature(_forward()[0]), signature(_backward_call())
    compiled.clear()
    fkey, bkey = recipes.forward_key(call, target), recipes.backward_key(bcall, target)
    assert compiled == []
    assert fkey == forward_recipe(call, target).key and bkey == backward_recipe(bcall, target).key
    assert compiled == ["ForwardKey recipe", "BackwardKey recipe"]
