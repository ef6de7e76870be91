"""``python -m checkpointables``: the same as the ``checkpointables`` command."""

import sys

from checkpointables.cli import main

sys.exit(main())
