"""``python -m graphrunner``: see :mod:`graphrunner_ref.cli.main`."""

from __future__ import annotations

import sys

from graphrunner_ref.cli.main import main

sys.exit(main())
