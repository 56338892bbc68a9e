"""
serve.py's host work alone, a model of what a GPU leaves the host (issue 57): `python -m benchmarks.serve_host
[--clients=32] [--tokens=300] [--repeats=3]`. serve.py runs as users run it, on a random character model (65
characters, 1 layer, 32 wide) whose forward is stood in for by a logits tensor made at once (a GPU's step is a graph
replay the host barely waits for), so what bounds it is the engine's Python and the HTTP streams'. Printed per run:
tokens/s of C streaming clients (benchmarks.serve.load) and the CPU time a token of the server's event loop (its
main thread) and of its other threads (the engine's), read from /proc. Linux only (/proc).
"""

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHARS = "".join(chr(c) for c in range(32, 97))  # 65 characters


def stand_in_forward(self, idx, targets=None, kv_cache=None, every_position=False):
    """GPT.forward's stand-in in the server's process: zeros logits for the last position of each row, at once."""
    return torch.zeros(idx.size(0), idx.size(1) if every_position else 1, self.config.vocab_size), None


# serve.py run as its command is, with GPT.forward stood in for (the benchmarks import no command)
SERVE = ("import runpy, sys, model; from benchmarks.serve_host import stand_in_forward; "
         "model.GPT.forward = stand_in_forward; sys.argv[0] = 'serve.py'; "
         "runpy.run_path('serve.py', run_name='__main__')")


def model_dir(directory):
    """A random character model as a Hugging Face directory (meta.json holds its characters)."""
    from machinery.data.meta import DatasetMeta
    from machinery.data.tokenizer import CharTokenizer
    from machinery.weights import convert
    from model import GPT, GPTConfig

    meta = DatasetMeta.of(CharTokenizer(CHARS))
    config, tensors = convert.to_hf(GPT(GPTConfig(block_size=1024, vocab_size=len(CHARS), n_layer=1, n_head=2,
                                                  n_embd=32, bias=True, gelu="tanh")), meta)
    convert.write_hf(directory, config, tensors, meta)
    return directory


def cpu_seconds(pid):
    """{thread id: seconds of CPU (user + system)} of the process's threads."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def measure(url, pid, clients, tokens):
    """One run: (tokens/s, the loop's CPU seconds a token, the other threads')."""
    from benchmarks import serve

    prompts = [[(i * 7 + j) % len(CHARS) for j in range(12)] for i in range(clients)]
    before = cpu_seconds(pid)
    _, rate, _, _ = asyncio.run(serve.load(url, [(p, i) for i, p in enumerate(prompts)], tokens))
    after = cpu_seconds(pid)
    loop = after[pid] - before[pid]
    rest = sum(seconds - before.get(tid, 0) for tid, seconds in after.items() if tid != pid)
    return rate, loop / (clients * tokens), rest / (clients * tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from benchmarks import serve

    with tempfile.TemporaryDirectory() as directory:
        port = serve.free_port()
        proc = subprocess.Popen([sys.executable, "-c", SERVE, f"--init_from={model_dir(directory)}", "--device=cpu",
                                 "--dtype=float32", f"--port={port}"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("serving"):
                    break
            url = f"http://127.0.0.1:{port}/v1/completions"
            measure(url, proc.pid, 2, 20)  # (warm-up)
            for _ in range(args.repeats):
                rate, loop, rest = measure(url, proc.pid, args.clients, args.tokens)
                print(f"{args.clients} clients x {args.tokens} tokens: {rate:,.0f} tokens/s; CPU a token: the event "
                      f"loop {loop * 1e6:.0f} µs, the other threads {rest * 1e6:.0f} µs", flush=True)
                time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
