"""Interleaved webdataset shards: ingest, pre-tokenize, and resumable packed streaming."""
