"""``python -m layerzero.cli``: the command line."""

import sys

from layerzero.cli import main

sys.exit(main())
