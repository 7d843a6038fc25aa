"""`python -m solrl.cli ...`: the `solrl` command."""

import sys

from solrl.cli.app import main

sys.exit(main())
