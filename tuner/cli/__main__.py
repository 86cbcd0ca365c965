"""``python -m tuner.cli``: the ``dynspec-tuner`` command."""

import sys

from tuner.cli import main

sys.exit(main())
