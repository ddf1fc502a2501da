"""``python -m layerzero.runtime.front``: the front process (``process.main``)."""

import sys

from layerzero.runtime.front.process import main

sys.exit(main())
