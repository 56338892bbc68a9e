"""What tests/test_gguf.py asks llama.cpp (llama-cpp-python) about a GGUF file, each function run in a child
process of its own (native.in_child): plain data in, plain data out (lists, numpy arrays), so that the child
imports only llama_cpp and numpy (and benchmarks.llama_runs, the benchmark's own runs of llama.cpp, where those are
under test)."""

import contextlib

import numpy as np

from benchmarks import llama_runs


@contextlib.contextmanager
def llama(path, n_ctx):
    """The GGUF file at path loaded by llama.cpp: float32 KV cache (its default, float16, would round the keys
    and values), every position's logits, 2 threads."""
    import gguf

    llm = llama_runs.load(path, n_ctx, 2, n_batch=n_ctx, type_k=gguf.GGMLQuantizationType.F32,
                          type_v=gguf.GGMLQuantizationType.F32)
    try:
        yield llm
    finally:
        llm.close()


def logits(llm, ids):
    """llama.cpp's logits (len(ids), vocab) of every position of ids, from an empty cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def vocab_and_logits(path, ids):
    """(the file's vocabulary size, the logits of every position of ids)."""
    with llama(path, len(ids)) as llm:
        return llm.n_vocab(), logits(llm, ids)


def tokenizer(path, texts, ids):
    """llama.cpp's tokenizer from the file: each text's ids with specials parsed and without, the text of each
    list of ids, and its end-of-text and beginning-of-text ids."""
    with llama(path, 16) as llm:
        return ([llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
                [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
                [llm.detokenize(i).decode() for i in ids], llm.token_eos(), llm.token_bos())


def greedy_and_logits(path, prompt, n, ids):
    """bench.py's greedy decoding of n tokens after prompt (its default float16 KV cache, 2 threads), and the
    logits of every position of ids (float32 KV cache)."""
    greedy = llama_runs.llama_cpp_greedy(str(path), prompt, n, threads=2)()
    with llama(path, len(ids)) as llm:
        return greedy, logits(llm, ids)


def text_losses(paths, ids, block_size):
    """bench.py's total cross-entropy (nats) of ids under each GGUF file of paths."""
    return [llama_runs.llama_cpp_text_loss(str(p), ids, block_size, threads=2) for p in paths]


def chat(path, n_ctx, texts, conversations):
    """A chat model's file: its template and end-of-turn id (metadata), each text tokenized with specials parsed,
    and llama-cpp-python's greedy chat completion of each conversation (its content, finish_reason)."""
    with llama(path, n_ctx) as llm:
        answers = [llm.create_chat_completion(messages=m, temperature=0, max_tokens=20)["choices"][0]
                   for m in conversations]
        return (llm.metadata["tokenizer.chat_template"], int(llm.metadata["tokenizer.ggml.eot_token_id"]),
                [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
                [(a["message"]["content"], a["finish_reason"]) for a in answers])
