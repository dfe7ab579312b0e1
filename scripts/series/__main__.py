# SPDX-License-Identifier: Apache-2.0
import os
import sys

from scripts.series.cli import main

try:
    sys.exit(main())
except BrokenPipeError:
    # The reader went away (`... check | head`): no traceback for that.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)
