"""The engine: one ``step()`` joins the scheduler, the cache and the runtime (``engine.py``),
assembled from configs (``build.py``); request checks, token bookkeeping and outputs around
it. Import the modules, not this package: it re-exports nothing, so ``failures.py`` and
``outputs.py`` stay cheap to import."""
