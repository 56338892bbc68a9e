"""Generation: sample.py's and serve.py's engine. Which model to load, requests and their streams, the scheduler
(engine.py), the model runner, the decoding step and its KV cache, the prefix cache, the CPU's packed layers and
kernels; and what a model's heads look at (plot.py --attention). Imports the shared basics, data/ and weights/;
never training/ or serving/."""
