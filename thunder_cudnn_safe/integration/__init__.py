"""Thunder integration: the only subpackage that registers anything with thunder. The two executors and
``explain()``/``describe()`` (:mod:`.executor`), their place in thunder's defaults (:mod:`.install`) and
``enable_gqa`` for thunder's SDPA with the repeat_kv transform (:mod:`.gqa`).

May import every other subpackage; none of them imports it (the package's ``__init__`` re-exports it).
"""
