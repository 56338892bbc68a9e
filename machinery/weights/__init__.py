"""Weights: a model's files. The checkpoint format, GPT-2's layouts (its files' reader, machinery/gpt2_weights.py,
sits below model.py with the basics), LoRA, GGUF export, int8 weights. Imports the shared basics and data/ (a
checkpoint carries its dataset's metadata)."""
