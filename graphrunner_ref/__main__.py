"""``python -m graphrunner_ref``: the same command line as ``python -m graphrunner``."""

from __future__ import annotations

import sys

from graphrunner_ref.cli.main import main

sys.exit(main())
