"""Training components: the Lightning module, callbacks, checkpoint IO and the optimizer (imports the model, never the CLI)."""
