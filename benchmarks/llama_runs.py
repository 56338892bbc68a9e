"""
llama.cpp (llama-cpp-python) running our GGUF exports, as bench.py --mode=serve measures it against our engine and
the GGUF tests check it: greedy decoding a token per call, and the cross-entropy of a text. Only numpy and
llama_cpp are imported (here, lazily), so that a test can run these in a child process of its own cheaply
(tests/native.py: a crash inside llama.cpp then fails one test). llama-cpp-python is built for the CPU at hand,
without llama.cpp's AMX kernels: .ci/install-llama-cpp.
"""

import contextlib
import io


def load(path, n_ctx, threads, **settings):
    """The GGUF file at path in llama.cpp: n_ctx positions, every position's logits kept, threads threads (its
    notes on stderr hidden); settings: more of Llama's."""
    from llama_cpp import Llama

    with contextlib.redirect_stderr(io.StringIO()):
        return Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, logits_all=True,
                     verbose=False, **settings)


def llama_cpp_greedy(path, prompt, n, threads):
    """A function that decodes n tokens greedily after prompt in llama.cpp (llama-cpp-python, as it loads a GGUF
    file by default: float16 KV cache) on threads threads, one token per call as our engine steps."""
    import numpy as np

    llm = load(path, len(prompt) + n + 1, threads)

    def run():
        llm.reset()
        llm.eval(prompt)
        tokens = []
        for _ in range(n):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        return tokens
    return run


def llama_cpp_text_loss(path, ids, block_size, threads):
    """The total cross-entropy (nats) of the GGUF model at path predicting ids[1:], in the windows of
    scoring.text_loss: ids[kB : kB + B + 1], each read from an empty cache (log-softmax in float64)."""
    import numpy as np

    llm = load(path, block_size, threads, n_batch=block_size)
    total = 0.0
    for start in range(0, len(ids) - 1, block_size):
        x, y = ids[start:start + block_size], ids[start + 1:start + block_size + 1]
        llm.reset()
        llm.eval(x[:len(y)])
        logits = np.array(llm.scores[:len(y)], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        total += float((np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(len(y)), y]).sum())
    llm.close()
    return total
