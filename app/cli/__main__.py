"""``python -m app.cli``: the ``cadence`` command."""

import sys

from app.cli import main

sys.exit(main())
