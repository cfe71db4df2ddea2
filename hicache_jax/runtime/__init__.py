"""The device side of a step: the jitted model step and its compiled programs
(``runner.py``, ``compiles.py``), sampling and penalties (``sampler.py``, ``penalties.py``),
and page copies between device and host (``transfer.py``). Everything here imports JAX."""
