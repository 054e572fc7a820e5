"""lm-evaluation-harness, imported on demand: one line when it is missing or too old for transformers 5."""
from __future__ import annotations

import os
from types import ModuleType

MIN_VERSION = (0, 4, 10)  # the first lm-eval that runs on transformers 5 (shared/DESIGN.md)
INSTALL = "pip install 'bigtrain[eval]'"


def require_lm_eval() -> ModuleType:
    """The `lm_eval` package; ValueError in one line (what to install) when it is missing or older than 0.4.10."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        found = version("lm_eval")
    except PackageNotFoundError:
        raise ValueError(f"evaluation needs EleutherAI's lm-evaluation-harness, which is not installed: {INSTALL} "
                         "(or pip install 'lm-eval>=0.4.10')") from None
    if _version_tuple(found) < MIN_VERSION:
        raise ValueError(f"lm-eval {found} is installed but bigtrain needs lm-eval >= 0.4.10 (the first that runs "
                         f"on transformers 5): {INSTALL}")
    offline_datasets()
    import lm_eval
    return lm_eval


def offline_datasets() -> None:
    """Where the Hugging Face hub cannot be reached, `datasets` would spend minutes retrying before it reads a local
    file or the cache; with HF_HUB_OFFLINE set (as on machines without a network) it goes straight to them."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)
