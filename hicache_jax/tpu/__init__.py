"""Compiling for TPU chips without one: targets (``target.py``), the serving step built from
shapes (``abstract.py``) and the slice planner (``planner.py``). libtpu compiles for TPU
topologies on any machine; nothing here runs a TPU program."""
