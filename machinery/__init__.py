"""The machinery the commands share (train.py, sample.py, prepare.py, eval.py, export.py, plot.py, bench.py and
serve.py at the root, around model.py): one job per file, listed in README.md. Nothing runs on import."""
