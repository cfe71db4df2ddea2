"""The engine's drafter for ``--speculative_algorithm``: ``(request, most tokens) -> draft``
(``scheduler/drafts.py`` decides who drafts and how much; this module, what)."""

from __future__ import annotations

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.request import Req
from hicache_jax.speculative.ngram import NgramConfig, NgramIndex


class NgramDrafter:
    """Prompt lookup over the request's own tokens (``ngram.NgramIndex``, one per request,
    kept on the request)."""

    def __init__(self, config: NgramConfig):
        self.config = config

    def __call__(self, req: Req, k: int) -> list[int]:
        if req.drafter_state is None:
            req.drafter_state = NgramIndex(self.config)
        return req.drafter_state.propose(req.input_ids + req.output_ids, k)

    def may_draft_next(self, req: Req) -> bool:
        """Whether ``req`` could draft after one more token, whichever it is (its tokens so
        far known; ``NgramIndex.can_follow``)."""
        self(req, 0)  # brings its index up to its tokens
        return req.drafter_state.can_follow()


class MtpDrafter:
    """The drafts the model's multi-token-prediction block (or an EAGLE-3 draft in its
    place) proposed in the request's last step (``runtime/mtp_drafts.py``; the engine keeps
    them on the request)."""

    def __call__(self, req: Req, k: int) -> list[int]:
        return list(req.drafter_state or ())[:k]

    def may_draft_next(self, req: Req) -> bool:
        return True  # its block proposes after every token


MTP_ALGORITHMS = ("NEXTN", "EAGLE")  # SGLang's names for drafting with the model's MTP blocks
DRAFT_MODEL_ALGORITHMS = ("EAGLE3",)  # a draft checkpoint run in the MTP block's place


def make_drafter(cfg: EngineConfig, mc) -> NgramDrafter | MtpDrafter | None:
    """The drafter ``cfg`` asks for (None: speculation off); refuses a model without the MTP
    blocks NEXTN drafts with, naming the flag. ``mc``: the model's config (its blocks).
    Every cache kind rolls back after a rejected draft (``docs/speculative.md``)."""
    if not cfg.spec_width:
        return None
    algorithm = cfg.speculative_algorithm.upper()
    if algorithm in MTP_ALGORITHMS:
        if mc.nextn is None and not mc.v4_blocks:
            raise ConfigError(
                f"speculative_algorithm={cfg.speculative_algorithm!r} drafts with the model's "
                "multi-token-prediction blocks, and this model has none (DeepSeek V3/V3.2/V4, "
                "GLM-5, Qwen3-Next and Qwen3.5 checkpoints ship them): use NGRAM"
            )
    if algorithm in MTP_ALGORITHMS + DRAFT_MODEL_ALGORITHMS:
        return MtpDrafter()  # the engine gives the model its drafter (``build.attach_drafter``)
    return NgramDrafter(
        NgramConfig(cfg.speculative_ngram_min_match_window_size, cfg.speculative_ngram_max_match_window_size)
    )
