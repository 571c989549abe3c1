"""`python -m gigadecode …` (also what torchrun launches)."""

import sys

from .cli import main

sys.exit(main())
