"""``n > 1``: several choices (samples) of one prompt, as engine requests.

Order is prompt-major, as in OpenAI and SGLang: choice ``j`` of prompt ``i`` is output
``i * n + j`` (OpenAI's choice ``index``; SGLang's position in the returned list).

The prompt is computed once: choice 0 runs first and choices 1..n-1 wait
(``Engine.add_request(after=...)``) until it has computed the prompt, then take its pages
from the radix tree, up to the usable (page-aligned) prefix; their ``cached_tokens`` show it.

Fairness: ``n`` is at most ``--max_n`` (OpenAI's 128), and the choices of one request form a
``group``: while other requests wait, a group holds at most half the running batch
(``scheduler.py``), so one client's many choices cannot starve the others.

Seeds: with ``seed`` S, choice ``j`` samples with seed ``(S + j) mod 2**32`` (vLLM's rule; the
sampler keys on the seed modulo 2**32 anyway). So a seeded request returns the same n outputs
every time, choice ``j`` is exactly what an ``n = 1`` request with seed ``S + j`` returns, and
the choices differ. Without a seed each choice draws its own, independently.
"""

from __future__ import annotations

from hicache_jax.sampling_params import InvalidRequest, SamplingParams, show

SEED_MODULUS = 2**32


def check_n(n, num_prompts: int, limit: int, max_n: int, field: str = "n") -> int:
    """``n`` (None: 1) if it is an integer in [1, ``max_n``] and ``num_prompts * n`` choices
    are at most ``limit``; InvalidRequest naming ``field`` otherwise."""
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool):
        raise InvalidRequest(f"{field} must be an integer, got {show(n)}")
    if n < 1:
        raise InvalidRequest(f"{field} must be >= 1, got {n}")
    if n > max_n:
        raise InvalidRequest(f"{field}={n}: at most {max_n} choices per prompt (--max_n)")
    if n * num_prompts > limit:
        raise InvalidRequest(
            f"{field}={n} for {num_prompts} prompt(s) makes {n * num_prompts} choices; "
            f"at most {limit} per request"
        )
    return n


def choice_seed(seed: int, j: int) -> int:
    """Choice ``j``'s seed for a request seeded with ``seed``."""
    return (seed + j) % SEED_MODULUS


def expand(reqs: list[dict], n: int) -> list[dict]:
    """Each engine request (one per prompt, ``add_request`` keyword arguments with a rid and
    SGLang ``sampling_params``) as ``n`` choices: rids ``<rid>_<j>``, seeds per choice,
    choices 1..n-1 after choice 0, all in the group ``<rid>``. ``n == 1`` returns ``reqs``
    unchanged."""
    if n == 1:
        return reqs
    out = []
    for req in reqs:
        params = dict(req.get("sampling_params") or {})
        seed = SamplingParams.from_dict(params).seed  # checked (range, type) before deriving
        params.pop("sampling_seed", None)  # SGLang's name for it
        first = f"{req['rid']}_0"
        for j in range(n):
            sp = dict(params, seed=None if seed is None else choice_seed(seed, j))
            choice = dict(req, rid=f"{req['rid']}_{j}", sampling_params=sp, group=req["rid"])
            if j:
                choice["after"] = first
            out.append(choice)
    return out


def take_n(params: list, limit: int, max_n: int) -> tuple[list, int]:
    """SGLang's ``sampling_params.n`` (one per prompt; it must be the same in each) and the
    params without it."""
    ns = [
        check_n(p.get("n"), len(params), limit, max_n, "sampling_params.n")
        for p in params
        if isinstance(p, dict)
    ]
    if len(set(ns)) > 1:
        raise InvalidRequest(f"sampling_params.n must be the same for every prompt, got {sorted(set(ns))}")
    rest = [{k: v for k, v in p.items() if k != "n"} if isinstance(p, dict) else p for p in params]
    return rest, ns[0] if ns else 1
