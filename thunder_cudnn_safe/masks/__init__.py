"""Masks: an attention mask read once per distinct mask, as cuDNN's additive bias (:mod:`.bias`), as one of
cuDNN's own masking patterns (:mod:`.patterns`: causal, sliding window, padding) or as packed documents
(:mod:`.documents`: a block-diagonal mask recognized exactly, as per-document lengths).

May import only the package's plumbing (``config``, ``caches``, ``lru``, ``telemetry``): what a mask *is*
does not depend on how a call runs, so every other subpackage may read it.
"""
