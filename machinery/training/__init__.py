"""Training: train.py's parts around its loop. The run's out_dir, evaluation, scoring, the CUDA-graph step, the
compile trial, the attention kernel, stopping on non-finite numbers, the metrics log. Imports the shared basics,
data/ and weights/; never generation/ or serving/."""
