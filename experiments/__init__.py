"""The end-to-end demo and the experiments, run from a checkout (`python train.py demo`, `python train.py experiment
NAME`); not installed with the library packages. Each experiment is one module listed in `run.EXPERIMENTS`."""
