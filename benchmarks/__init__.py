"""Benchmarks for thunder_cudnn_safe (see benchmarks/README.md).

Three suites answer what the safe executor costs:

* ``copy``: bytes copied by layout normalization per forward+backward for the layout
  zoo, under ``cudnn_safe_layout="preserve"`` and ``"contiguous"``, read from
  :func:`thunder_cudnn_safe.copy_stats` (counted by the package), and the time those
  copies take. Runs on CPU (and on a GPU when one is present).
* ``host``: Python time of one forward / backward dispatch on a graph-cache hit,
  execute excluded, against constructing and validating one SDPA pygraph per call
  (what thunder's built-in cuDNN executor does before its cache lookup).
* ``gpu``: forward / backward time and TFLOP/s against sdpaex, eager
  ``F.scaled_dot_product_attention`` and thunder's built-in cuDNN executor. CUDA only.

Command line: ``python -m benchmarks.run --suite {copy,host,gpu,all} --out DIR``.
pytest-benchmark: ``python -m pytest benchmarks/ --benchmark-only``.
"""
