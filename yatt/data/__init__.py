"""Task data sets in the yatt JSONL prompt format."""
