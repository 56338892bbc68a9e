"""
Train a GPT. One process on a laptop CPU or one GPU:

    python train.py config/train_shakespeare_char.py --batch_size=32

or data-parallel over many GPUs / nodes with torchrun:

    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

Every setting is a field of TrainConfig below; `python train.py --help` lists them.
"""

import gc
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

import checkpoint
import configurator
from configurator import UserError
from data import BatchSampler, load_meta, load_split, whole_split_batches
from hardware import autocast, peak_flops, pick_device, pick_dtype
from model import GPT, GPTConfig


def _(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = _("out", "directory for checkpoints (ckpt.pt: latest state, best.pt: best val weights)")
    eval_interval: int = _(2000, "evaluate train/val loss every this many iterations")
    log_interval: int = _(1, "print a training log line every this many iterations")
    eval_iters: int = _(200, "batches per split in each evaluation")
    eval_only: bool = _(False, "evaluate once and exit")
    eval_at_start: bool = _(True, "evaluate before the first step too (False saves that time, e.g. in a speedrun)")
    eval_whole_val: bool = _(False, "val loss over the whole val split in order (exact, the same windows every time; "
                                     "one forward pass over it) instead of eval_iters random batches")
    always_save_checkpoint: bool = _(True, "write ckpt.pt at every evaluation, not only when val loss improves")
    ckpt_interval: int = _(1000, "also write ckpt.pt every this many iterations (0: only at evals and the end)")
    init_from: str = _("scratch", "scratch (new model), resume (continue from out_dir/ckpt.pt), or GPT-2 weights "
                                  "to finetune: gpt2, gpt2-medium, gpt2-large, gpt2-xl (local Hugging Face cache) "
                                  "or a Hugging Face GPT-2 directory")
    # wandb
    wandb_log: bool = _(False, "log to Weights & Biases")
    wandb_project: str = _("owt", "wandb project name")
    wandb_run_name: str = _("gpt2", "wandb run name")
    # data
    dataset: str = _("openwebtext", "dataset name: reads DATA_DIR/DATASET/{train,val}.bin")
    data_dir: str = _("data", "directory holding the datasets")
    gradient_accumulation_steps: int = _(40, "micro-batches per optimizer step, over all processes together")
    batch_size: int = _(12, "sequences per micro-batch per process")
    block_size: int = _(1024, "context length in tokens")
    # model
    n_layer: int = _(12, "transformer blocks")
    n_head: int = _(12, "attention heads per block")
    n_embd: int = _(768, "embedding width (divisible by n_head)")
    dropout: float = _(0.0, "dropout probability (0 for pretraining, 0.1+ for finetuning)")
    bias: bool = _(False, "biases in Linear and LayerNorm layers")
    vocab_size: Optional[int] = _(None, "vocabulary size (None: from the dataset's meta.json, else 50304)")
    gelu: str = _("none", "GELU approximation: none (exact) or tanh (GPT-2)")
    # AdamW
    learning_rate: float = _(6e-4, "peak learning rate")
    max_iters: int = _(600000, "optimizer steps in total")
    weight_decay: float = _(1e-1, "AdamW weight decay (matrices and embeddings only)")
    beta1: float = _(0.9, "AdamW beta1")
    beta2: float = _(0.95, "AdamW beta2")
    grad_clip: float = _(1.0, "clip gradients at this global norm (0: no clipping)")
    # learning rate schedule
    decay_lr: bool = _(True, "cosine decay after warmup (False: constant learning_rate)")
    warmup_iters: int = _(2000, "linear warmup steps")
    lr_decay_iters: int = _(600000, "step at which the cosine reaches min_lr (about max_iters)")
    min_lr: float = _(6e-5, "final learning rate (about learning_rate / 10)")
    # system
    device: str = _("auto", "auto (cuda, mps, cpu), cpu, cuda, cuda:N or mps")
    dtype: str = _("auto", "auto (bfloat16 on capable GPUs, else float16 on CUDA, float32 elsewhere), float32, bfloat16, float16")
    compile: Optional[bool] = _(None, "torch.compile the model (None: on for CUDA)")
    parallel: str = _("ddp", "under torchrun: ddp (replicate the model) or fsdp (shard it)")
    seed: int = _(1337, "random seed")

    def validate(self):
        positive = ["eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                    "block_size", "n_layer", "n_head", "n_embd"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_iters", "warmup_iters", "lr_decay_iters", "ckpt_interval"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise UserError(f"vocab_size must be positive, got {self.vocab_size}")
        if not self.learning_rate > 0:
            raise UserError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.min_lr < 0 or self.min_lr > self.learning_rate:
            raise UserError(f"min_lr must be between 0 and learning_rate, got {self.min_lr}")
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0 <= self.dropout < 1:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.init_from not in ("scratch", "resume"):
            import convert

            convert.find_pretrained(self.init_from)  # GPT-2 weights: a clear error for a bad name or path
        if self.parallel not in ("ddp", "fsdp"):
            raise UserError(f"parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.gelu not in ("none", "tanh"):
            raise UserError(f"gelu must be none or tanh, got {self.gelu!r}")


def get_lr(it, cfg):
    """Linear warmup (never 0 at step 0), then cosine decay to min_lr at lr_decay_iters."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


# ---------------------------------------------------------------------- distributed


@dataclass
class Dist:
    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(device_name):
    """Join the torchrun job if there is one (env:// rendezvous); pick this process's device."""
    if "RANK" not in os.environ:
        return Dist(), pick_device(device_name)
    import torch.distributed as dist

    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(device_name)
    if device == "mps":
        raise UserError("torchrun on mps is not supported (no collective backend for it); train in one process, "
                        "or add --device=cpu")
    if device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"process {local_rank} on this node has no GPU of its own ({torch.cuda.device_count()} "
                            f"GPUs here); start at most that many with torchrun --nproc_per_node")
        device = f"cuda:{local_rank}"  # one process per GPU
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, device_id=torch.device(device) if backend == "nccl" else None)
    return Dist(True, rank, local_rank, world), device


def teardown_distributed(finished):
    """Leave the process group, if any. After a normal end, first wait until every rank is done: gloo
    aborts a process whose peer hangs up while it is still exchanging data. After an error, leave at
    once (the other ranks then fail on their next collective, or torchrun stops them)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce(tensor, op="sum"):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def gather_objects(obj, ddp):
    """A list with every rank's obj (just [obj] in a single process)."""
    if not ddp.enabled:
        return [obj]
    import torch.distributed as dist

    out = [None] * ddp.world_size
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------- RNG state, for exact resume


def rng_state():
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(_to_tuple(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------------- training


class Trainer:
    """Owns the model, optimizer, data and loop of one training run (one process)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.ddp, self.device = setup_distributed(cfg.device)
        self.device_type = self.device.split(":")[0]
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.ctx = autocast(self.device, self.dtype)
        self.log = print if self.ddp.master else (lambda *a, **k: None)
        if cfg.gradient_accumulation_steps % self.ddp.world_size:
            raise UserError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by "
                            f"the number of processes ({self.ddp.world_size})")
        self.accum = cfg.gradient_accumulation_steps // self.ddp.world_size  # micro-steps on this rank
        self._prepare_out_dir()

        data_dir = os.path.join(cfg.data_dir, cfg.dataset)
        self.meta = load_meta(data_dir) or {"tokenizer": "gpt2", "vocab_size": 50257}
        self.train_data = load_split(data_dir, "train", cfg.block_size)
        self.val_data = load_split(data_dir, "val", cfg.block_size)

        if self.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.iter_num, self.best_val_loss, self.wandb_run_id = 0, float("inf"), None
        ckpt = checkpoint.load(os.path.join(cfg.out_dir, checkpoint.LATEST)) if cfg.init_from == "resume" else None
        if cfg.init_from in ("scratch", "resume"):
            self.model_config = self._model_config(ckpt)
            self.raw_model = GPT(self.model_config)
        else:
            self.raw_model = self._from_pretrained()
            self.model_config = self.raw_model.config
        if ckpt:
            checkpoint.load_weights(self.raw_model, ckpt)
        self.raw_model.to(self.device)
        if self.ddp.enabled and cfg.parallel == "fsdp":
            self._shard(self.raw_model)  # before the optimizer, which must see the sharded parameters
        self.optimizer = self.raw_model.configure_optimizers(
            cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), self.device_type)
        # fp16 gradients can underflow: scale the loss up, and skip steps whose gradients overflow
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=(self.dtype == "float16"))
        # a non-finite loss is recorded on the device (no sync every step) and checked when logging/saving
        self.nonfinite_at = torch.full((), -1, dtype=torch.long, device=self.device)

        # The batches continue torch's random stream from just after the model's initialisation, where
        # nanoGPT's get_batch draws them (other ranks: a stream of their own). So nanoGPT's config and seed
        # give nanoGPT's run: the same initial weights, the same batches, the same losses (README, Results).
        generator = torch.Generator()
        if self.ddp.rank == 0:
            generator.set_state(torch.get_rng_state())
        else:
            generator.manual_seed(cfg.seed + 1000 * self.ddp.rank + 1)
        self.train_sampler = BatchSampler(self.train_data, cfg.batch_size, cfg.block_size, generator, self.device)
        torch.manual_seed(cfg.seed + self.ddp.rank)  # dropout differs between ranks
        random.seed(cfg.seed + self.ddp.rank)
        np.random.seed(cfg.seed + self.ddp.rank)
        if ckpt:
            self._restore(ckpt)
        starts = gather_objects(self.iter_num, self.ddp)
        if len(set(starts)) > 1:
            raise UserError(f"the processes resumed from different checkpoints (iterations {starts}); out_dir must "
                            f"be one shared directory, or hold the same {checkpoint.LATEST}, on every node")
        self.model = self._wrap(self.raw_model)

    # -- setup helpers

    def _prepare_out_dir(self):
        out_dir = self.cfg.out_dir
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise UserError(f"out_dir {out_dir} is a file; pick a directory with --out_dir")
        if not self.ddp.master:
            return
        try:
            os.makedirs(out_dir, exist_ok=True)
            probe = os.path.join(out_dir, f".write_test.{os.getpid()}")
            with open(probe, "w"):
                pass
            os.remove(probe)
            checkpoint.remove_stale_temps(out_dir)  # left by a process killed while saving
        except OSError as e:
            raise UserError(f"out_dir {out_dir} is not writable ({e.strerror}); pick another --out_dir") from None

    def _model_config(self, ckpt):
        cfg, meta = self.cfg, self.meta
        data_vocab = meta.get("vocab_size")
        if ckpt is None:
            vocab = cfg.vocab_size or data_vocab or 50304
            if data_vocab and vocab < data_vocab:
                raise UserError(f"vocab_size {vocab} is smaller than the dataset's vocabulary ({data_vocab})")
            try:
                mc = GPTConfig(block_size=cfg.block_size, vocab_size=vocab, n_layer=cfg.n_layer, n_head=cfg.n_head,
                               n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias, gelu=cfg.gelu)
                mc.validate()
            except ValueError as e:
                raise UserError(str(e)) from None
            return mc
        mc = checkpoint.model_config(ckpt)
        path = os.path.join(cfg.out_dir, checkpoint.LATEST)
        for name in ("n_layer", "n_head", "n_embd", "block_size", "bias"):
            if getattr(mc, name) != getattr(cfg, name):
                raise UserError(f"{path} has {name}={getattr(mc, name)} but the config asks for "
                                f"{getattr(cfg, name)}; resume with the same model settings or start from scratch")
        if data_vocab and mc.vocab_size < data_vocab or (cfg.vocab_size and cfg.vocab_size != mc.vocab_size):
            raise UserError(f"{path} has vocab_size={mc.vocab_size} but dataset {cfg.dataset} needs {data_vocab}; "
                            f"resume on the dataset it was trained on")
        ckpt_tok = ckpt.get("tokenizer")
        if ckpt_tok and ckpt_tok.get("tokenizer") == "char" and ckpt_tok.get("chars") != meta.get("chars"):
            raise UserError(f"{path} was trained on a different character vocabulary than dataset {cfg.dataset}; "
                            f"resume on the dataset it was trained on")
        mc.dropout = cfg.dropout  # dropout may change on resume
        return mc

    def _from_pretrained(self):
        """GPT-2 weights to finetune. They fix the model (n_layer, n_head, n_embd, bias, gelu, vocab_size);
        a smaller block_size crops the position embedding; dropout comes from the config."""
        import convert

        cfg, meta = self.cfg, self.meta
        want = convert.pretrained_meta(cfg.init_from)
        if (meta.get("tokenizer"), meta.get("chars")) != (want.get("tokenizer"), want.get("chars")):
            raise UserError(f"dataset {cfg.dataset} is tokenized with {meta.get('tokenizer')}, but {cfg.init_from} "
                            f"was trained with {want.get('tokenizer')}; prepare the data with that tokenizer "
                            f"(for GPT-2 BPE: python prepare.py shakespeare, or prepare.py text --tokenizer gpt2)")
        model = GPT.from_pretrained(cfg.init_from, dropout=cfg.dropout)
        mc = model.config
        if meta.get("vocab_size", 0) > mc.vocab_size:
            raise UserError(f"dataset {cfg.dataset} has {meta['vocab_size']} tokens, more than {cfg.init_from}'s "
                            f"vocab_size {mc.vocab_size}")
        if cfg.block_size > mc.block_size:
            raise UserError(f"block_size {cfg.block_size} is larger than {cfg.init_from}'s {mc.block_size}; "
                            f"use --block_size={mc.block_size} or less")
        if cfg.block_size < mc.block_size:
            model.crop_block_size(cfg.block_size)
        for name in ("n_layer", "n_head", "n_embd", "bias", "gelu", "vocab_size"):  # so train_config tells the truth
            setattr(cfg, name, getattr(mc, name))
        self.log(f"initialized from {cfg.init_from}: n_layer={mc.n_layer}, n_head={mc.n_head}, n_embd={mc.n_embd}, "
                 f"vocab_size={mc.vocab_size}, block_size={mc.block_size}, bias={mc.bias}, gelu={mc.gelu}")
        return model

    def _restore(self, ckpt):
        self.load_optimizer_state_dict(ckpt["optimizer"])
        self.iter_num = ckpt["iter_num"]
        self.best_val_loss = ckpt.get("best_val_loss", float("inf"))
        self.wandb_run_id = ckpt.get("wandb_run_id")
        if "scaler" in ckpt and self.scaler.is_enabled():
            self.scaler.load_state_dict(ckpt["scaler"])
        ranks = ckpt.get("ranks")
        if ranks and len(ranks) == self.ddp.world_size:
            mine = ranks[self.ddp.rank]
            self.train_sampler.load_state_dict(mine["sampler"])
            set_rng_state(mine["rng"])
        elif ranks:
            self.log(f"note: checkpoint was written by {len(ranks)} processes, now {self.ddp.world_size}: "
                     f"data order and dropout are reseeded")
        self.log(f"resuming from {self.cfg.out_dir}/{checkpoint.LATEST} at iteration {self.iter_num}")

    @staticmethod
    def _shard(model):
        """FSDP: each block's parameters (then the rest) are split across the ranks."""
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    def _wrap(self, model):
        cfg = self.cfg
        use_compile = cfg.compile if cfg.compile is not None else self.device_type == "cuda"
        if self.ddp.enabled and cfg.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[self.ddp.local_rank] if self.device_type == "cuda" else None)
        if use_compile:
            model = self._try_compile(model)
        return model

    def _try_compile(self, model):
        """torch.compile, checked on one forward/backward; on failure warn once and go on uncompiled."""
        compiled = torch.compile(model)
        saved = self.train_sampler.state_dict(), rng_state()  # the trial must not shift data or dropout
        try:
            x, y = self.train_sampler.next()
            with self.ctx:
                _, loss = compiled(x, y)
            loss.backward()
            return compiled
        except Exception as e:  # compilers fail in many ways; training can still go on
            self.log(f"warning: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                     f"training without it")
            return model
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.train_sampler.load_state_dict(saved[0])
            set_rng_state(saved[1])

    # -- evaluation and checkpoints

    @torch.no_grad()
    def estimate_loss(self):
        """Mean loss over eval_iters batches of each split (or the whole val split with eval_whole_val),
        split over the ranks and averaged. As in nanoGPT, the random batches come from the training
        batches' stream (so a resumed run, which evaluates again at its first step, draws the same ones).
        Every rank evaluates the same number of sampled batches (an FSDP forward is a collective), rounded up."""
        cfg, ddp = self.cfg, self.ddp
        self.model.eval()
        out = {}
        for split, data in (("train", self.train_data), ("val", self.val_data)):
            if split == "val" and cfg.eval_whole_val:
                batches = whole_split_batches(data, cfg.batch_size, cfg.block_size, self.device,
                                              ddp.rank, ddp.world_size)
            else:
                sampler = BatchSampler(data, cfg.batch_size, cfg.block_size, self.train_sampler.generator,
                                       self.device)
                batches = (sampler.next() for _ in range(math.ceil(cfg.eval_iters / ddp.world_size)))
            loss_sum, windows = torch.zeros((), device=self.device, dtype=torch.float64), 0
            for x, y in batches:
                with self.ctx:
                    _, loss = self.model(x, y)
                loss_sum += loss.double() * len(x)  # weighted: the whole split's last batch can be smaller
                windows += len(x)
            totals = all_reduce(torch.stack([loss_sum, torch.tensor(float(windows), device=self.device,
                                                                    dtype=torch.float64)]))
            out[split] = (totals[0] / totals[1]).item()
        self.model.train()
        return out

    # Checkpoints hold full (unsharded) state on the CPU, the optimizer's keyed by parameter name rather
    # than position: a checkpoint written by any number of processes, with DDP or FSDP, resumes under
    # any other and loads in a single-process sample.py. With several processes only rank 0 gets the
    # state (the others get {}); every rank must call these, as FSDP gathers the shards.
    def model_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.raw_model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        groups = state.get("param_groups") or [{}]
        if groups[0].get("params") and isinstance(groups[0]["params"][0], int):
            # keyed by position: a plain optimizer.state_dict(), as nanoGPT writes (same parameter order)
            if self.cfg.parallel == "fsdp" and self.ddp.enabled:
                raise UserError("this checkpoint's optimizer state is keyed by position (nanoGPT's format); "
                                "resume it once without FSDP (one process or --parallel=ddp), then with FSDP")
            self.optimizer.load_state_dict(state)
            return
        set_optimizer_state_dict(self.raw_model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
        for group in self.optimizer.param_groups:  # the round trip turns tuples into lists; keep AdamW's own types
            group["betas"] = tuple(group["betas"])

    def save(self, which):
        """Write ckpt.pt (full state) or best.pt (weights); every rank must call it (state is gathered)."""
        self.check_finite(sync=True)
        model_state = self.model_state_dict()
        # a finite loss can still come with an overflowing gradient that turned the weights into NaN
        if not all(torch.isfinite(v).all() for v in model_state.values() if v.is_floating_point()):
            raise UserError(f"the weights became NaN or infinite by iteration {self.iter_num}; stopping without "
                            f"saving, the last good checkpoint in {self.cfg.out_dir} is untouched (try a lower "
                            f"learning_rate, grad_clip, or dtype=bfloat16)")
        state = {
            "model": model_state,
            "model_config": asdict(self.model_config),
            "train_config": asdict(self.cfg),
            "iter_num": self.iter_num,
            "best_val_loss": self.best_val_loss,
            "tokenizer": self.meta,
        }
        if which == checkpoint.LATEST:
            # the sampler state from before the batch already fetched, so a resumed run fetches it again
            ranks = gather_objects({"rng": rng_state(), "sampler": self.batch_state}, self.ddp)
            state.update({
                "optimizer": self.optimizer_state_dict(),
                "scaler": self.scaler.state_dict(),
                "ranks": ranks,
                "wandb_run_id": self.wandb_run_id,
            })
        if self.ddp.master:
            checkpoint.save(state, os.path.join(self.cfg.out_dir, which))
        self.saved_at[which] = self.iter_num

    def check_finite(self, sync=False):
        """Stop (without saving) once a non-finite loss has been seen; sync=True (every rank calls it):
        seen on any rank."""
        if not hasattr(self, "nonfinite_at"):
            return
        bad = self.nonfinite_at.clone()
        if sync and self.ddp.enabled:
            all_reduce(bad, op="max")
        bad = int(bad.item())
        if bad >= 0:
            raise UserError(f"the loss became NaN or infinite in iteration {bad}; stopping without saving, the last "
                            f"good checkpoint in {self.cfg.out_dir} is untouched (try a lower learning_rate, "
                            f"grad_clip, or dtype=bfloat16)")

    # -- the loop

    def train(self):
        cfg, ddp = self.cfg, self.ddp
        tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.log(f"tokens per iteration: {tokens_per_iter:,} "
                 f"({ddp.world_size} process(es) x {self.accum} micro-steps x {cfg.batch_size} x {cfg.block_size})")
        self.log(f"parameters: {self.raw_model.get_num_params() / 1e6:.2f}M; device {self.device}, dtype {self.dtype}")
        wandb_run = self._start_wandb() if cfg.wandb_log and ddp.master else None
        stop = StopFlag()
        flops_peak = peak_flops(self.device)

        self.saved_at = {}
        x, y = self.next_batch()
        t0 = time.time()
        running_mfu, local_iter = -1.0, 0
        while True:
            lr = get_lr(self.iter_num, cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr

            if (self.iter_num % cfg.eval_interval == 0 and (local_iter > 0 or cfg.eval_at_start)
                    or self.iter_num >= cfg.max_iters or cfg.eval_only):
                self.check_finite(sync=True)
                losses = self.estimate_loss()
                self.log(f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                if not math.isfinite(losses["val"]):
                    raise UserError(f"validation loss is not finite at iteration {self.iter_num}; stopping without saving")
                if wandb_run:
                    metrics = {"iter": self.iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr}
                    if running_mfu >= 0:  # -1 until measured (never on a CPU)
                        metrics["mfu"] = running_mfu * 100
                    wandb_run.log(metrics, step=self.iter_num)
                if cfg.eval_only:
                    break
                improved = losses["val"] < self.best_val_loss
                if improved:
                    self.best_val_loss = losses["val"]
                    if self.iter_num > 0:
                        self.save(checkpoint.BEST)
                # (again when improved, even if just saved: ckpt.pt keeps best_val_loss for a resumed run)
                if self.iter_num > 0 and (improved or (cfg.always_save_checkpoint
                                                       and self.saved_at.get(checkpoint.LATEST) != self.iter_num)):
                    self.save(checkpoint.LATEST)
                t0 = time.time()  # evaluation time is not training time
            if self.iter_num >= cfg.max_iters:
                break

            loss, x, y = self.train_step(x, y)

            t1 = time.time()
            dt, t0 = t1 - t0, t1
            self.iter_num += 1
            local_iter += 1
            if self.iter_num % cfg.log_interval == 0 and ddp.master:
                self.check_finite()
                lossf = loss.item() * self.accum  # the last micro-batch's loss (syncs with the device)
                line = f"iter {self.iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, " \
                       f"tok/s {tokens_per_iter / dt:,.0f}"
                if flops_peak and local_iter >= 5:  # skip the first iterations (compilation, warm-up)
                    mfu = self.raw_model.estimate_mfu(cfg.batch_size * self.accum, dt, flops_peak)  # per device
                    running_mfu = mfu if running_mfu < 0 else 0.9 * running_mfu + 0.1 * mfu
                    line += f", mfu {running_mfu * 100:.2f}%"
                self.log(line)
                if wandb_run:
                    wandb_run.log({"iter": self.iter_num, "train/loss_step": lossf, "lr": lr}, step=self.iter_num)
            # saving never waits for an evaluation: every ckpt_interval steps, on a signal, and right after
            # the last step (before the final evaluation, which could fail). Under DDP, asking the other
            # ranks about signals syncs with the device: only on steps that log (which sync anyway).
            stopping = stop.requested(ddp, self.device, ask_ranks=self.iter_num % cfg.log_interval == 0)
            if stopping or self.iter_num == cfg.max_iters or (cfg.ckpt_interval
                                                             and self.iter_num % cfg.ckpt_interval == 0):
                self.save(checkpoint.LATEST)
            if stopping:
                self.log(f"stopped by {stop.name} at iteration {self.iter_num}; checkpoint saved in "
                         f"{cfg.out_dir}/{checkpoint.LATEST}. Resume with the same command and --init_from=resume")
                break
        if not cfg.eval_only and self.saved_at.get(checkpoint.LATEST) != self.iter_num:
            self.save(checkpoint.LATEST)  # the final state, whatever the evaluation said
        stop.restore()
        if wandb_run:
            wandb_run.finish()

    def train_step(self, x, y):
        """One optimizer step: accum micro-batches on this rank, the first being (x, y); gradients are
        synchronised across ranks only on the last one (DDP's no_sync / FSDP's requires_gradient_sync).
        Returns the last micro-batch's loss (divided by accum) and the next batch."""
        guard_nan = not self.scaler.is_enabled()  # with fp16 the GradScaler skips bad steps instead
        for micro_step in range(self.accum):
            with self._sync_gradients(micro_step == self.accum - 1):
                with self.ctx:
                    _, loss = self.model(x, y)
                    loss = loss / self.accum  # the mean over micro-steps; DDP averages over ranks
                if guard_nan:
                    bad = ~torch.isfinite(loss.detach())
                    # numbered as the `iter N:` log line of this step
                    self.nonfinite_at = torch.where(bad & (self.nonfinite_at < 0), self.iter_num + 1,
                                                    self.nonfinite_at)
                x, y = self.next_batch()  # fetch the next batch while the device works
                self.scaler.scale(loss).backward()
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, x, y

    def next_batch(self):
        self.batch_state = self.train_sampler.state_dict()
        return self.train_sampler.next()

    def _sync_gradients(self, sync):
        if sync or not self.ddp.enabled:
            return nullcontext()
        if self.cfg.parallel == "fsdp":
            return _FSDPNoSync(self.raw_model)
        return self.model.no_sync()  # a compiled model forwards this to the DDP module it wraps

    def _start_wandb(self):
        import wandb

        # a resumed run passes the id from its checkpoint and continues that wandb run; a new run gets
        # a fresh id from wandb, which goes into every checkpoint from now on
        run = wandb.init(project=self.cfg.wandb_project, name=self.cfg.wandb_run_name, id=self.wandb_run_id,
                         resume="allow", config=asdict(self.cfg))
        self.wandb_run_id = run.id
        return run


class _FSDPNoSync:
    """FSDP2's counterpart of DDP's no_sync(): skip the gradient reduce-scatter for this micro-step."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


class StopFlag:
    """SIGINT / SIGTERM ask the loop to finish its step, save and exit 0; a second one acts as usual
    (Ctrl-C twice interrupts at once, and the atomic save leaves the previous checkpoint whole)."""

    def __init__(self):
        self.name = None
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        self.name = signal.Signals(signum).name
        self.restore()

    def requested(self, ddp, device, ask_ranks=True):
        """Has a signal come? Under DDP every rank must stop at the same step, so a signal counts only
        on steps with ask_ranks (the same on every rank), where any rank's signal stops them all."""
        if not ddp.enabled:
            return self.name is not None
        if not ask_ranks:
            return False
        flag = all_reduce(torch.tensor([1.0 if self.name else 0.0], device=device), op="max").item() > 0
        if flag and self.name is None:
            self.name = "a signal on another rank"
        return flag

    def restore(self):
        for sig, handler in self.previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


def main(argv=None):
    cfg = configurator.parse(TrainConfig, argv, usage="python train.py [config/FILE.py ...] [--key=value ...]")
    cfg.validate()
    finished, trainer = False, None
    try:
        trainer = Trainer(cfg)
        trainer.train()
        finished = True
    finally:
        # free the model (and DDP's reducer, which uses the process group) before leaving the group: it sits
        # in a reference cycle, and destroyed later, at exit, it aborted 3 of 60 2-rank gloo runs (0 of 60 so)
        del trainer
        gc.collect()
        teardown_distributed(finished)


if __name__ == "__main__":
    configurator.run_main(main)
