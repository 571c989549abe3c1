"""What a checkpoint's `generation_config.json` adds: stop tokens beyond config.json's and sampling defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint's `generation_config.json` says: stop tokens that join config.json's
    `eos_token_id`, and sampling defaults for requests that set none (vLLM's `--generation-config auto`)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: tuple[tuple[str, Any], ...] = ()       # (SamplingParams field, value), e.g. ("temperature", 1.0)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        path = Path(model_dir) / "generation_config.json"
        if not path.exists():
            return cls()
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: not UTF-8 text ({e})") from None
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        eos = d.get("eos_token_id")
        eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos):
            raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them (got {d.get('eos_token_id')!r})")
        sampling = []
        for k in SAMPLING_DEFAULT_KEYS:
            if d.get(k) is not None:
                sampling.append(("max_tokens" if k == "max_new_tokens" else k, d[k]))
        from .sampling import SamplingError, SamplingParams
        try:                        # checked now: a bad default would fail every request that leaves it unset
            SamplingParams.from_dict(dict(sampling))
        except SamplingError as e:
            raise ConfigError(f"{path}: {e}") from None
        return cls(tuple(int(t) for t in eos), tuple(sampling))
