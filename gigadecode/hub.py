"""`--model` by name: a Hugging Face repo id (`openai/gpt-oss-20b`) resolved to a snapshot already in the
local Hugging Face cache, offline (`local_files_only`), as vLLM and transformers do. A path that exists is
used as it is."""

from __future__ import annotations

import re
from pathlib import Path

from .config import ConfigError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(name: str | Path) -> Path:
    """A model directory for `name`: the path itself when it exists, else the cached snapshot of the repo id."""
    path = Path(name).expanduser()
    if path.exists() or not REPO_ID.match(str(name)):
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:                                  # pragma: no cover - a dependency of tokenizers
        raise ConfigError(f"--model {name}: no such directory, and huggingface_hub is not installed") from None
    try:
        snap = snapshot_download(str(name), local_files_only=True,
                                 allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except LocalEntryNotFoundError:
        raise ConfigError(f"--model {name}: no such directory, and no snapshot of the Hugging Face repo {name!r} "
                          f"in the local cache (HF_HOME / HF_HUB_CACHE); download it first, e.g. "
                          f"`hf download {name}`, or pass the checkpoint's directory") from None
    except Exception as e:  # noqa: BLE001 - a malformed cache or repo id
        raise ConfigError(f"--model {name}: cannot use the Hugging Face cache: {type(e).__name__}: {e}") from None
    return Path(snap)
