"""``python -m graphrunner``: see :mod:`graphrunner.cli`."""

from __future__ import annotations

import sys

from graphrunner.cli import main

sys.exit(main())
