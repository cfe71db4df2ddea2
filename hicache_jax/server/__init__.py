"""The HTTP server: SGLang's native API and OpenAI's, over one engine thread.

Start it with ``python -m hicache_jax.serve --flagfile=configs/cpu.flags``. Importing this
package is cheap (no FastAPI, no JAX) so that flag parsing can fail fast.
"""
