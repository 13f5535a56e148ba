"""``python -m graphrunner``: see :mod:`graphrunner.cli.main`."""

from __future__ import annotations

import sys

from graphrunner.cli.main import main

sys.exit(main())
