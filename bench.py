"""
Benchmarks: this project's speed against a reference run on the same machine, one mode per job.

Generation, training (beside nanoGPT's own train.py too), the speedrun, corpus preparation, serving, and serving
under faults; the measured figures, with their commands and machines, are in BENCHMARKS.md.

    python bench.py --mode=sample --n_layer=6 --n_head=6 --n_embd=384 --block_size=1024 --vocab_size=65 --device=cpu
    python bench.py config/train_shakespeare_char.py --mode=train --batch_size=8 --device=cpu
    python bench.py config/train_gpt2.py --mode=train --dataset=shakespeare --nanogpt=../nanoGPT/train.py
    python bench.py --mode=speedrun --repeats=3 [--recipe=gpu] [--nanogpt=../nanoGPT/train.py]

mode=sample: tokens/s of greedy generation (batch 1, a random prompt) with the KV cache and
without it (re-running the whole context for every token, as nanoGPT), on the same model in
the same run, and whether the two paths produced the same tokens.

mode=train: ms/iter and tokens/s (and MFU on GPUs) of train.py's own training step
(Trainer.optimizer_step: forward, backward, gradient clipping, the optimizer) with its device, dtype,
autocast, compile and CUDA-graph settings, on random tokens, timed as train.py runs it (no wait for the
device between iterations but its log lines' every log_interval). With --nanogpt=PATH (nanoGPT's train.py, from a clone
of its repository), then our train.py and nanoGPT's as whole processes with the same settings on the
prepared dataset, warmup + repeats steps each: wall time, val loss, ms/iter, tokens/s and MFU side by
side, and how far apart their losses are step by step. See benchmarks/runs.py.

mode=speedrun: the speedrun (--recipe=cpu or gpu) against nanoGPT's recipe run by our train.py, both whole
`python train.py` processes (start-up, data, training, evaluation, checkpoint) on the prepared
shakespeare_char in data_dir, in turn `repeats` times (with --nanogpt, the recipe through nanoGPT's
train.py too); prints each pair's wall times, their ratio and val losses, then the medians side by side.

mode=prepare: tokens/s and the peak memory of the process tree of the large-corpus preparation
(prepare.py fineweb_edu --input: corpus.prepare_corpus on num_proc processes, timed whole) against
tiktoken's multi-threaded encode_ordinary_batch on the same documents (its encode calls alone), in
the same run; the two token counts must agree. Without --input, a synthetic corpus of corpus_mb MiB
is written first; it and the shards go to a temporary directory ($TMPDIR). See benchmarks/prepare.py.

    python bench.py --mode=prepare [--input=PATH] [--corpus_mb=500] [--num_proc=N]

mode=faults: serve.py against a long prompt among running streams, clients that stop reading, clients that
hang up (benchmarks/faults.py).

mode=serve: serve.py under load (streaming clients at once: tokens/s, time to the first token, gaps between
tokens; seeded requests at once against one at a time; a one-token completion after prompts of prompt_lens
tokens, at dtype and at float32) and batch-1 decoding of the generation engine (also with
int8 weights) and of sample.py, whole process, against transformers' generate and llama.cpp (Q8_0, F16), on a
random model of GPT-2's architecture, with the memory bound; with --text, bits per byte of a trained model
(--out_dir) in float32, int8 and llama.cpp's q8_0. See benchmarks/serve.py.

    python bench.py --mode=serve [--clients=1,8,32] [--serve_tokens=100] [--prompt_lens=64,256,...] [--dtype=auto]
                                 [--device=cuda] [--out_dir=DIR --text=FILE]

mode=chat: chat finetuning shown to work: a small GPT-2 BPE model pretrained on text_source, then finetuned at the
same steps on a synthetic conversational task (full or LoRA, the loss on the assistant's tokens or on all), each
model's held-out exact-match accuracy, share of replies ending with <|assistant_end|> and masked loss, as a
markdown table. See benchmarks/chat.py.

    python bench.py --mode=chat [--chat_pretrain=task|text] [--chat_pretrain_iters=150] [--chat_sft_iters=400]

mode=gpu: every goal of the GPU issues in one command that fits a GPU's few lent minutes (--budget_s): the CUDA
tests, sample.py against transformers (bfloat16, float32), the decoding levers side by side (decode_attention,
compile) with the top kernels per decoded token, serve.py at 1 / 8 / 32 clients and at max_batch 1, Muon's step
against AdamW's and GPT-2 124M's step and MFU as train.py runs them, the training levers side by side (cuda_graph,
compile, the micro-batch) with the top kernels of a step, the GPU speedrun against nanoGPT's recipe; a PASS / FAIL
line a goal, a row a lever, then the table for BENCHMARKS.md. --parts runs some of them. With --device=cpu a small
quick form that prints every line (the figures a CPU cannot take: not measured). See benchmarks/gpu.py.

    python bench.py --mode=gpu                 # on the GPU machine (the wheels it lacks: see README)
    python bench.py --mode=gpu --parts=tests,sample,decode,serve   # then --parts=train, then --parts=speedrun
    python bench.py --mode=gpu --device=cpu    # the quick form, here

mode=tokenizers: char, GPT-2 and BPEs learned at 4k-32k on a text (default: the Tang poems): characters and bytes a
token, learning time; then one model shape trained for the same wall time on char, GPT-2 and the 16k BPE: val bits
per byte and a sample of each. See benchmarks/tokenizers.py.

    python bench.py --mode=tokenizers [--input=PATH] [--train_s=300]

mode=conversation: the prefix cache through serve.py: a GPT-2-shaped model's time to the first token at each of 8
turns of a conversation with and without the cache, 8 conversations at once, the server's memory under a flood of
distinct prompts. See benchmarks/conversation.py.

    python bench.py --mode=conversation [--flood=2000]

Every train.py setting is a setting here too, so training config files work as they are;
vocab_size defaults to the configured dataset's when it has been prepared. Each figure is the
median of `repeats` measurements taken after `warmup` unmeasured ones.
"""

import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import machinery.torch_import  # noqa: F401  (first: torch imported with the collector paused, a faster start)

import numpy as np
import torch

from benchmarks.chat import bench_chat
from benchmarks.conversation import bench_conversation
from benchmarks.faults import bench_faults
from benchmarks.gpu import PARTS as GPU_PARTS
from benchmarks.gpu import bench_gpu
from benchmarks.prepare import bench_prepare
from benchmarks.profile import kernel_table, top_kernels
from benchmarks.runs import NANOGPT_RECIPES, bench_beside_nanogpt, bench_speedrun, check_nanogpt
from benchmarks.serve import bench_serve
from benchmarks.serve import synchronize as sync
from benchmarks.tokenizers import bench_tokenizers
from machinery import configurator
from machinery.data import dataset, meta
from machinery.configurator import setting
from machinery.errors import UserError, run_main
from machinery.hardware import describe as describe_device
from machinery.hardware import peak_flops
from train import TrainConfig, Trainer


@dataclass
class BenchConfig(TrainConfig):
    mode: str = setting("sample", "sample (generation with and without the KV cache), train (one training step), "
                               "speedrun (whole train.py runs), prepare (corpus preparation), serve (serve.py "
                               "under load; batch-1 decoding against transformers), faults (serve.py against "
                               "long prompts, clients that stop reading or hang up), chat (chat finetuning, "
                               "four ways, on a synthetic task), gpu (every GPU goal in one command, PASS / FAIL "
                               "a line; --device=cpu: its quick form), tokenizers (char, GPT-2 and learned BPEs "
                               "on a text: compression, and models trained for the same wall time) or conversation "
                               "(serve.py's prefix cache over the turns of conversations)")
    warmup: int = setting(1, "unmeasured runs (sample) or iterations (train) before the measured ones (compilation, "
                             "caches)")
    repeats: int = setting(3, "measured runs or iterations; the median is reported")
    max_new_tokens: int = setting(500, "mode=sample: tokens to generate per run (batch 1, greedy)")
    prompt_len: int = setting(8, "mode=sample: tokens in the random prompt")
    threads: int = setting(0, "CPU threads for PyTorch (0: its default, one per core)")
    recipe: str = setting("cpu", "mode=speedrun: cpu (the CPU speedrun against nanoGPT's CPU recipe) or gpu (the GPU "
                                 "speedrun against nanoGPT's GPU recipe, config/train_shakespeare_char.py)")
    speedrun: str = setting("", "mode=speedrun: the speedrun's config file (empty: config/speedrun_shakespeare_char_"
                                "RECIPE.py)")
    nanogpt: str = setting("", "mode=train and speedrun: the path of nanoGPT's train.py (a clone of its repository) "
                               "to run beside ours on the same data (empty: none)")
    input: str = setting("", "mode=prepare: the corpus, as prepare.py fineweb_edu --input takes it (a file or "
                             "directory of JSON lines / parquet with a text field); empty: a synthetic one; "
                             "mode=tokenizers: the text file (empty: ../shared/data/chinese-poetry/quantangshi.txt)")
    train_s: int = setting(300, "mode=tokenizers: seconds of wall time each model trains")
    corpus_mb: int = setting(500, "mode=prepare without --input: MiB of synthetic JSON lines to write first")
    text_source: str = setting("../shared/data/tinyshakespeare/input.txt", "mode=prepare: the text the "
                                                                          "synthetic corpus is cut from; mode=chat "
                                                                          "with chat_pretrain=text: the text the base "
                                                                          "model is pretrained on")
    num_proc: int = setting(0, "mode=prepare: prepare's processes and tiktoken's threads (0: every core)")
    shard_tokens: int = setting(0, "mode=prepare: tokens per shard (0: prepare.py's 100M)")
    clients: str = setting("1,8,32", "mode=serve: numbers of concurrent streaming clients, comma-separated")
    serve_tokens: int = setting(100, "mode=serve: tokens each request generates")
    prompt_lens: str = setting("64,256,512,768,900,1017", "mode=serve: prompt lengths (tokens, comma-separated) "
                                                          "after which a one-token completion through serve.py is "
                                                          "timed, at dtype and at float32 (empty: none)")
    text: str = setting("", "mode=serve: a held-out UTF-8 text: bits per byte on it of the trained GPT-2 BPE model "
                            "in out_dir, float32, int8 and llama.cpp's q8_0 (empty: not measured)")
    chat_pretrain: str = setting("task", "mode=chat: the base model's pretraining text: task (the training "
                                         "conversations as plain text, without roles or special tokens) or text "
                                         "(text_source)")
    chat_pretrain_iters: int = setting(150, "mode=chat: steps of pretraining the base model")
    chat_sft_iters: int = setting(400, "mode=chat: steps of each finetuning on the conversations")
    chat_train: int = setting(4000, "mode=chat: training conversations generated")
    parts: str = setting(",".join(GPU_PARTS), "mode=gpu: the parts to run, comma-separated (two commands where one "
                                              "would not fit a lent GPU's time for a command)")
    budget_s: int = setting(480, "mode=gpu: seconds the command may take; its last part, the GPU speedrun pair "
                                 "(~300 s on an H100), runs only when that much is left")
    chat_heldout: int = setting(50, "mode=chat: held-out conversations generated (2 or 3 replies each)")
    flood: int = setting(2000, "mode=conversation: distinct long prompts sent to a small model's server with a "
                               "64 MB prefix cache, its memory watched (0: none)")

    def validate(self):
        super().validate()
        if self.mode not in ("sample", "train", "speedrun", "prepare", "serve", "faults", "chat", "gpu",
                             "tokenizers", "conversation"):
            raise UserError(f"mode must be sample, train, speedrun, prepare, serve, faults, chat, gpu, tokenizers or "
                            f"conversation, got {self.mode!r}")
        if not set(self.parts.split(",")) <= set(GPU_PARTS):
            raise UserError(f"parts must be some of {','.join(GPU_PARTS)} separated by commas, got {self.parts!r}")
        if self.flood < 0:
            raise UserError(f"flood must be 0 (no flood) or more prompts, got {self.flood}")
        if not all(c.strip().isdigit() and int(c) > 0 for c in self.clients.split(",")):
            raise UserError(f"clients must be positive numbers separated by commas, got {self.clients!r}")
        if self.mode == "serve" and self.prompt_lens and not all(n.strip().isdigit() and 0 < int(n) <= self.block_size
                                                                for n in self.prompt_lens.split(",")):
            raise UserError(f"prompt_lens must be numbers of tokens from 1 to block_size ({self.block_size}) "
                            f"separated by commas, got {self.prompt_lens!r}")
        if self.chat_pretrain not in ("task", "text"):
            raise UserError(f"chat_pretrain must be task or text, got {self.chat_pretrain!r}")
        if self.recipe not in NANOGPT_RECIPES:
            raise UserError(f"recipe must be cpu or gpu, got {self.recipe!r}")
        if self.nanogpt and self.mode not in ("train", "speedrun"):
            raise UserError(f"nanogpt is a setting of mode=train and mode=speedrun, not mode={self.mode}")
        if self.nanogpt:
            check_nanogpt(self.nanogpt)
        if self.mode == "speedrun" and self.recipe == "gpu" and not torch.cuda.is_available():
            raise UserError("recipe=gpu needs a CUDA GPU and this machine has none; use --recipe=cpu")
        if self.warmup < 0:
            raise UserError(f"warmup must not be negative, got {self.warmup}")
        if self.threads < 0:
            raise UserError(f"threads must not be negative, got {self.threads}")
        configurator.check_not_negative(self, "num_proc", "shard_tokens")
        configurator.check_positive(self, "repeats", "max_new_tokens", "prompt_len", "corpus_mb", "serve_tokens",
                                    "chat_pretrain_iters", "chat_sft_iters", "chat_train", "chat_heldout")
        if self.prompt_len > self.block_size:
            raise UserError(f"prompt_len ({self.prompt_len}) must be at most block_size ({self.block_size})")


def make_trainer(cfg, workdir, compile):
    """train.py's Trainer on a dataset of random tokens written to workdir: the model, device,
    dtype, autocast and optimizer exactly as a training run with these settings would have them."""
    # the vocabulary a training run on the configured dataset would have (GPT-2's when it is not prepared)
    vocab = cfg.vocab_size or meta.for_dataset(dataset.resolve(cfg.data_dir, cfg.dataset)).model_vocab_size
    data_dir = os.path.join(workdir, "random")
    os.makedirs(data_dir)
    tokens = np.random.default_rng(cfg.seed).integers(0, vocab, size=64 * (cfg.block_size + 1), dtype=np.uint16)
    for split in ("train", "val"):
        tokens.tofile(os.path.join(data_dir, f"{split}.bin"))
    meta.write(meta.DatasetMeta.of(None, vocab_size=vocab), data_dir)  # token ids without text
    run_cfg = dataclasses.replace(cfg, data_dir=workdir, dataset="random", out_dir=os.path.join(workdir, "out"),
                                  vocab_size=vocab, init_from="scratch", wandb_log=False, compile=compile)
    return Trainer(run_cfg)


def describe(trainer):
    mc = trainer.model_config
    return (f"model: {trainer.raw_model.get_num_params() / 1e6:.2f}M parameters ({mc.n_layer} layers, "
            f"{mc.n_head} heads, {mc.n_embd} wide, block_size {mc.block_size}, vocab {mc.vocab_size}); "
            f"{describe_device(trainer.device, trainer.dtype)}")


def bench_sample(cfg, workdir):
    trainer = make_trainer(cfg, workdir, compile=False)
    device = trainer.device
    use_compile = cfg.compile if cfg.compile is not None else trainer.device_type == "cuda"
    model = trainer.raw_model.eval()
    if use_compile:
        model.compile(dynamic=True)  # as sample.py --compile
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(model.config.vocab_size, (1, cfg.prompt_len), generator=g).to(device)

    def run(use_cache):
        sync(device)
        t0 = time.perf_counter()
        with trainer.autocast:
            out = model.generate(prompt, cfg.max_new_tokens, temperature=0, use_cache=use_cache)
        sync(device)
        return time.perf_counter() - t0, out

    print(describe(trainer) + f", compile {use_compile}")
    print(f"batch 1, prompt {cfg.prompt_len} tokens, {cfg.max_new_tokens} new tokens, greedy; "
          f"{cfg.warmup} warm-up + {cfg.repeats} measured runs of each path, alternating")
    times, outs = {True: [], False: []}, {}
    for i in range(cfg.warmup + cfg.repeats):
        for use_cache in (True, False):
            dt, outs[use_cache] = run(use_cache)
            run_name = "warm-up" if i < cfg.warmup else f"run {i - cfg.warmup + 1}"
            print(f"  {run_name:8} {'cached' if use_cache else 'uncached':9} {dt:8.2f} s", flush=True)
            if i >= cfg.warmup:
                times[use_cache].append(dt)
    rate = {c: cfg.max_new_tokens / statistics.median(times[c]) for c in times}
    print(f"{'':10} {'tokens/s':>10}   (median)")
    for use_cache, name in ((True, "cached"), (False, "uncached")):
        print(f"{name:10} {rate[use_cache]:10,.1f}")
    same = torch.equal(outs[True], outs[False])
    print(f"speed-up with the KV cache: {rate[True] / rate[False]:.1f}x; "
          f"greedy tokens identical: {'yes' if same else 'NO'}")
    return rate, same


def bench_train(cfg, workdir):
    """train.py's training step in this process; with cfg.nanogpt, then ours and nanoGPT's train.py side by side."""
    seconds = bench_step(cfg, workdir).seconds
    if cfg.nanogpt:
        bench_beside_nanogpt(cfg, workdir, TrainConfig)
    return seconds


def gpu_step(workdir):
    """mode=gpu's measurement of a training step: a function of bench.py's arguments (a config file and
    --key=value settings) that runs mode=train's step there (StepFigures; profile: with its top kernels)."""
    def step(argv, profile=False):
        cfg = configurator.parse(BenchConfig, argv)
        cfg.validate()
        return bench_step(cfg, tempfile.mkdtemp(prefix="step-", dir=workdir), profile)
    return step


@dataclass
class StepFigures:
    """mode=train's figures of a training step: the median seconds of an iteration, its tokens, the MFU (None where
    no peak is known), and with profile the top kernels of one more iteration (benchmarks/profile.py)."""

    seconds: float
    tokens: int
    mfu: object
    kernels: str = ""


def bench_step(cfg, workdir, profile=False):
    """train.py's optimizer step (Trainer.optimizer_step) timed as train.py runs it: the measured iterations back to
    back, the host waiting for the device only where train.py does (reading the loss for a log line, every
    log_interval iterations), each iteration's time read off the device's clock (StepClock). The warm-up iterations
    (compilation, capture) each alone."""
    trainer = make_trainer(cfg, workdir, compile=cfg.compile)
    compiled = trainer.model is not trainer.raw_model
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    print(describe(trainer) + f", compile {compiled}, CUDA graph {trainer.step_graph is not None}")
    print(f"one iteration: {cfg.gradient_accumulation_steps} micro-steps x batch {cfg.batch_size} x "
          f"{cfg.block_size} tokens = {tokens_per_iter:,} tokens; {cfg.warmup} warm-up + {cfg.repeats} measured, "
          f"the loss read every {cfg.log_interval} (log_interval)")
    x, y = trainer.next_batch()
    for i in range(cfg.warmup):
        sync(trainer.device)
        t0 = time.perf_counter()
        loss, x, y = trainer.optimizer_step(x, y)
        loss.item()
        print(f"  {'warm-up':8} {(time.perf_counter() - t0) * 1000:10.1f} ms", flush=True)
    clock = StepClock(trainer.device)
    for i in range(cfg.repeats):
        loss, x, y = trainer.optimizer_step(x, y)
        if (i + 1) % cfg.log_interval == 0:
            loss.item()  # train.py's log line (the only wait for the device in its loop)
        clock.mark()
    times = clock.intervals()
    for i, dt in enumerate(times):
        print(f"  {f'iter {i + 1}':8} {dt * 1000:10.1f} ms", flush=True)
    flops = peak_flops(trainer.device)
    print(f"{'':8} {'ms/iter':>10} {'tokens/s':>12} {'MFU':>8}")
    mfus = {}
    for name, dt in (("median", statistics.median(times)), ("min", min(times)), ("max", max(times))):
        mfus[name] = trainer.raw_model.estimate_mfu(cfg.batch_size * cfg.gradient_accumulation_steps, dt, flops) \
            if flops else None
        print(f"{name:8} {dt * 1000:10.1f} {tokens_per_iter / dt:12,.0f} {f'{mfus[name]:.1%}' if flops else '-':>8}")
    kernels = profiled_step(trainer, x, y) if profile else ""
    return StepFigures(statistics.median(times), tokens_per_iter, mfus["median"], kernels)


def profiled_step(trainer, x, y):
    """The top kernels of one more iteration of trainer's step (benchmarks/profile.py's table)."""
    def one():
        loss, _, _ = trainer.optimizer_step(x, y)
        loss.item()
    kernels, total = top_kernels(one, 1, trainer.device)
    return kernel_table("top kernels of one iteration", kernels, total, "iter")


class StepClock:
    """The times of consecutive iterations without making the host wait: on CUDA an event recorded after each
    iteration's work is queued, read once the last is done (each interval is then the device's time from one
    iteration's end to the next's: the rate train.py runs at, whether the device or the host is the slower); on
    a CPU, whose operators run as they are called, the host's clock."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        sync(device)
        self.marks = [self._now()]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self):
        self.marks.append(self._now())

    def intervals(self):
        """Seconds between consecutive marks (the first from the clock's start)."""
        sync(self.device)
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [start.elapsed_time(end) / 1000 for start, end in pairs]
        return [end - start for start, end in pairs]


def commands():
    """The commands mode=chat runs as a user would: their main(argv), by script."""
    import export
    import prepare
    import train

    return {"prepare.py": prepare.main, "train.py": train.main, "export.py": export.main}


def main(argv=None):
    cfg = configurator.parse(BenchConfig, argv, usage="python bench.py [config/FILE.py ...] [--key=value ...] --mode="
                                                      "sample|train|speedrun|prepare|serve|faults|chat|gpu|tokenizers|"
                                                      "conversation")
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory(prefix="bench-") as workdir:
        if cfg.mode == "speedrun":
            return bench_speedrun(cfg, workdir, TrainConfig)
        if cfg.mode == "chat":
            return bench_chat(cfg, workdir, commands())
        if cfg.mode == "gpu":
            return bench_gpu(cfg, workdir, gpu_step(workdir), TrainConfig)
        return {"sample": bench_sample, "train": bench_train, "prepare": bench_prepare,
                "serve": bench_serve, "faults": bench_faults, "tokenizers": bench_tokenizers,
                "conversation": bench_conversation}[cfg.mode](cfg, workdir)


if __name__ == "__main__":
    run_main(main)
