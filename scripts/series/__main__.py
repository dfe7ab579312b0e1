# SPDX-License-Identifier: Apache-2.0
import sys

from scripts.series.cli import main

sys.exit(main())
