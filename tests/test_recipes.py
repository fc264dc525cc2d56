"""A pack recipe prints the straight-line function it binds with (issue 31), and that text is the one it runs."""

from __future__ import annotations

import re

import torch

from thunder_cudnn_safe.plan.calls import BackwardCall, ForwardCall, signature
from thunder_cudnn_safe.plan.keys import Uid
from thunder_cudnn_safe.plan.recipes import PackRecipe, backward_recipe, bind, forward_recipe
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
