"""``python -m lowprec``: the same as the ``lowprec`` command (see :mod:`lowprec.cli`)."""

import sys

from .cli import main

sys.exit(main())
