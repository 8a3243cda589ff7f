"""Bare torchrun whose launcher skips interpreter teardown, as nbgpu's agent does.

    python bench/torchrun_no_teardown.py <torchrun arguments>

The launch benchmarks' like-for-like anchor: ``torch.distributed.run.main`` as the
``torchrun`` entry point calls it, then ``os._exit`` with its exit code once stdout and
stderr are flushed, instead of tearing torch down at interpreter exit. The ranks are
untouched (they tear down as in every other case). Not part of nbgpu.
"""

import logging
import os
import sys
import traceback

from torch.distributed.run import main

if __name__ == "__main__":
    code = 0
    try:
        main()
    except SystemExit as exc:  # argparse's errors and --help
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (ChildFailedError and the like: torchrun exits 1)
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
