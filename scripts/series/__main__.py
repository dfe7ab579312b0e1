# SPDX-License-Identifier: Apache-2.0
import os
import sys

# tomllib (3.11) and tarfile's extraction filters (3.11.4); checked before
# anything imports them, so an older Python gets a sentence, not a traceback.
MIN_PYTHON = (3, 11, 4)
if sys.version_info < MIN_PYTHON:
    sys.exit(
        f"error: the series tool needs Python {'.'.join(map(str, MIN_PYTHON))} "
        f"or newer; this is {sys.version.split()[0]} ({sys.executable})"
    )

from scripts.series.cli import main  # noqa: E402

try:
    sys.exit(main())
except BrokenPipeError:
    # The reader went away (`... check | head`): no traceback for that.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)
