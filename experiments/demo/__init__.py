"""The end-to-end demo on built-in offline data: its stages, settings, bookkeeping, evaluation and report."""
