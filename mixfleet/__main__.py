"""``python -m mixfleet``: the ``mixfleet`` command (see :mod:`mixfleet.cli`)."""

import sys

from mixfleet.cli import main

sys.exit(main())
