"""The gqa suite's byte counts equal the formulas of :func:`benchmarks.gqa_suite.formulas`, and the
transform shrinks what the backward keeps (pytest-benchmark times one forward+backward with it on)."""

from __future__ import annotations

import pytest

from benchmarks import gqa_suite

CASE = gqa_suite.Case(1, 64, 16, 4, 64)


@pytest.mark.parametrize("transform", [False, True])
def test_gqa_bytes_match_formulas(transform):
    row = gqa_suite.measure(CASE, transform)
    predicted = gqa_suite.formulas(CASE)
    tag = "with" if transform else "without"
    assert row["kv_heads_at_op"] == (CASE.hkv if transform else CASE.hq)
    for what in ("repeat", "saved", "dkv"):
        assert row[f"{what}_bytes"] == predicted[f"{what}_{tag}"], (what, row)
    assert row["copy_stats_bytes"] == 0


def test_gqa_forward_backward_with_transform(benchmark):
    row = benchmark(gqa_suite.measure, CASE, True)
    assert row["repeat_bytes"] == 0
