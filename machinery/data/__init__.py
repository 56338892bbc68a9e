"""Data: text to tokens to batches. The tokenizers, a dataset and its metadata (meta.json), llm.c's shards, large
corpora, the chat format and chat datasets. Imports only the shared basics (machinery/*.py)."""
