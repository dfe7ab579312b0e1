# SPDX-License-Identifier: Apache-2.0
import os
import sys

# tomllib (3.11); checked before anything imports it, so an older Python
# gets a sentence and the way on, not a traceback.
MIN_PYTHON = (3, 11)
if sys.version_info < MIN_PYTHON:
    sys.exit(
        f"error: the series tool needs Python 3.11 or newer; this is "
        f"{sys.version.split()[0]} ({sys.executable}). On Ubuntu 22.04: "
        "`sudo apt install python3.11 python3.11-venv`, then make nox's "
        "virtual environment with it: `python3.11 -m venv ~/.venvs/nox` "
        "(README, Quick start)"
    )

from scripts.series.cli import main  # noqa: E402

try:
    sys.exit(main())
except BrokenPipeError:
    # The reader went away (`... check | head`): no traceback for that.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)
