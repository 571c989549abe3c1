"""gigadecode: GPT-OSS inference with a fused whole-stack ("giga-kernel") decode program.

`from gigadecode import LLM, SamplingParams` (and `RequestOutput`, `CompletionOutput`, `Logprob`, the types
vLLM's scripts annotate with): vLLM's offline API (`llm.py`), imported on first use, so that
`import gigadecode` (the command line's first step) loads no torch before the OpenMP environment is set.

Import direction: config → mxfp4/rope → weights → model/gk kernels → kv → runner → engine → connector
→ llm/server/cli.
"""

__version__ = "0.1.0"

OFFLINE_API = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob")

__all__ = [*OFFLINE_API, "__version__"]


def __getattr__(name: str):
    if name in OFFLINE_API:
        from . import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'gigadecode' has no attribute {name!r}")
