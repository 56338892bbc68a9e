"""The machinery the commands share (train.py, sample.py, prepare.py, eval.py, export.py, plot.py, bench.py and
serve.py at the root, around model.py): one job per file, listed in README.md's file tree. Here the shared basics
(errors, files, settings, hardware, torchrun, and GPT-2's files, which model.py reads); the wings above them, in the
order they may import each other: data/, weights/, then training/ and generation/ (neither imports the other), then
serving/. Nothing runs on import."""
