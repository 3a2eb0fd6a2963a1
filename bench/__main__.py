"""`python -m bench [names] [--smoke] [--max-seconds S]`: see bench/run.py."""

import sys

from bench.run import main

sys.exit(main())
