"""Thunder integration: the only subpackage that imports thunder. The executors, one per registered runtime,
and ``explain()``/``describe()`` (:mod:`.executor`), their place in thunder's defaults (:mod:`.install`),
``enable_gqa`` for thunder's SDPA with the repeat_kv transform (:mod:`.gqa`), context parallelism's transform
and ring operators (:mod:`.context_parallel`), and the reading of thunder's
proxies and traces into the plain facts the rules judge (:mod:`.proxies`, :mod:`.grad_need`).

May import every other subpackage; none of them imports it (the package's ``__init__`` re-exports it).
"""
