"""Rules every package shares: atomic file writes and safe checkpoint reads, CPU thread choice, and the check that a
decoder, a vocabulary, an image tokenizer and token shards belong together."""
