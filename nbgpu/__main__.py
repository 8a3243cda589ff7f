"""``python -m nbgpu``: the CLI, for environments without the console script."""

from nbgpu.cli import main

raise SystemExit(main())
