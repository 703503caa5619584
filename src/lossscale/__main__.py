"""``python -m lossscale ...``: the same as the ``lossscale`` command."""

import sys

from .cli import main

sys.exit(main())
