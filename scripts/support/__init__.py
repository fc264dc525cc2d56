"""What scripts/ and tests/ share, in one place, imported without any ``sys.path`` edit.

A script (``python scripts/X.py``) runs with scripts/ first on its path, so ``from support import ...``
finds this package; pytest finds it through pyproject's ``pythonpath = ["scripts"]``. None of it is part of
thunder_cudnn_safe (what users may share with the tests is ``thunder_cudnn_safe.testing``).

* :mod:`support.lowering_calls`: the lowering sweep's calls and the graph keys the dispatcher builds for each
  (tests/test_cudnn_lowering.py, tests/test_cudnn_compile.py, scripts/compile_table.py);
* :mod:`support.compile_sweep`: the compile sweep's subset and the stand-in ``libcuda.so.1`` (its source stays in
  tests/standin_libcuda.c, built into a folder only a child process loads);
* :mod:`support.upstream_patch`: applying and loading upstream/cudnn_sdpa.patch (tests/test_upstream_patch.py,
  scripts/upstream_patch_evidence.py).
"""
