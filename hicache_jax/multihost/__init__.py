"""Several processes (hosts) serving one model on one mesh: ``jax.distributed`` set-up and
the per-step plan check (``distributed.py``), and process 0 deciding while the others
replay its engine calls (``replicated.py``)."""
