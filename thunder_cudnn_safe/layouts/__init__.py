"""Layouts: what a graph declares, as plain values. A graph's hashable key (:mod:`.keys`: every bound tensor's
dims, strides and dtype, the flags, the target, the ``Uid`` of every bound tensor) and the arithmetic of
layouts (:mod:`.layout`: cuDNN's 16-byte alignment and int32 element offsets, canonical and packed strides,
whether a tensor is readable as it is). The facts the rules read and the plans apply, below both. Also which
tokens of a sequence each context-parallel rank holds (:mod:`.sequence_shards`).

May import only the package's plumbing: the rules, the plans, the graphs and the runtimes all read it.
"""
