"""gigadecode: GPT-OSS inference with a fused whole-stack ("giga-kernel") decode program.

Import direction: config → mxfp4/rope → weights → model/gk kernels → kv → runner → engine → connector
→ server/cli.
"""

__version__ = "0.1.0"
