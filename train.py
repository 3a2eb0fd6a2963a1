"""The project's one command line: a subcommand per pipeline step (see `python train.py --help`)."""

import sys

from experiments.commands import main

if __name__ == "__main__":
    sys.exit(main())
