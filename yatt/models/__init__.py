"""Model folders: building tiny models with their tokenizers, loading and checking HF folders."""
