"""``python -m nbgpu``: the CLI, for environments without the console script."""

import sys

from nbgpu.cli import main

sys.exit(main())
