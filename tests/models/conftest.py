"""Selection and result collection for the model suite.

* default: the quick subset (a few models, bf16, ThunderFX) that CI runs;
* ``THUNDER_CUDNN_SAFE_MODELS=all``: every model in fp16 and bf16 under ThunderFX, and
  under ``thunder.jit`` in bf16;
* thunder with its default executors only is run where ours raised or broke the accuracy
  rule (so a failure thunder shares is not blamed on us), and for every case with
  ``THUNDER_CUDNN_SAFE_MODELS_COMPARE=always``;
* ``THUNDER_CUDNN_SAFE_MODELS=llama,t5``: those models, full matrix;
* ``THUNDER_CUDNN_SAFE_MODELS_JSON=path``: write every record to ``path`` (a JSON list)
  for ``scripts/models_table.py``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

_RECORDS: list[dict] = []


@pytest.fixture
def record_model():
    """Keep a model record for the JSON file (written at the end of the session)."""
    return _RECORDS.append


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("THUNDER_CUDNN_SAFE_MODELS_JSON")
    if path and _RECORDS:
        with open(path, "w") as f:
            json.dump(_RECORDS, f, indent=1, default=str)


@pytest.fixture(autouse=True)
def _pose_as_fixed_hopper():
    """The model suite tests our executor through models, so it poses as an H100 with cuDNN 9.26.

    On cuDNN < 9.26, ``HOPPER_BACKWARD_KV_TAIL_NAN`` declines every non-causal training call at key
    lengths 64, 192, ... (the tiny UNet's attention), which then runs on thunder's CPU decomposition:
    the model would measure thunder's bf16 decomposition, not this package. The rule's boundaries are
    tested in tests/test_defect_rules.py.
    """
    import thunder_cudnn_safe as tcs

    with tcs.config.patch(emulated_arch=(9, 0), emulated_backend=92600):
        yield
