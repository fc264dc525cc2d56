"""Runtimes: ``build(key)`` once per key and ``execute(built, pack)`` per call, the contract of :mod:`.base`
(the abstract :class:`~.base.Runtime`, the build ladder, and the one registry of the runtimes behind the
executors). cuDNN on a GPU (:mod:`.cudnn_runtime`, with one executable graph per thread, :mod:`.per_thread`,
and pooled handles, :mod:`.handles`) and ahead of time from a CPU (:mod:`.aot`); the CPU emulation that reads memory
through the declared strides as cuDNN does, dense and ragged (:mod:`.emulation`); the torch fallback for
refused calls (:mod:`.fallback`), which shares the float32 math of :mod:`.reference`; and
:mod:`.handoff`, the only state that crosses operator calls.

May import :mod:`~thunder_cudnn_safe.graphs`, :mod:`~thunder_cudnn_safe.routing`,
:mod:`~thunder_cudnn_safe.rules`, :mod:`~thunder_cudnn_safe.layouts`, :mod:`~thunder_cudnn_safe.masks` and
the plumbing; never the dispatcher or thunder.
"""
