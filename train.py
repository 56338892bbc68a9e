"""
Train a GPT. One process on a laptop CPU or one GPU:

    python train.py config/train_shakespeare_char.py --batch_size=32

or data-parallel over many GPUs / nodes with torchrun:

    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

Every setting is a field of TrainConfig below; `python train.py --help` lists them. Read it top to bottom: the
settings, main(), then the Trainer: its setup, the loop, and the loop's named steps (evaluate_and_checkpoint,
optimizer_step). When the loop evaluates or saves, and the evaluation itself, are machinery/training/evaluation.py's; the
learning-rate schedule is optimizers.get_lr; what a checkpoint records, checkpoint.training_state and resume_state.
"""

import os
import time
from dataclasses import dataclass, fields
from typing import Optional

import machinery.torch_import  # noqa: F401  (first: torch imported with the collector paused, a faster start)

import torch

from machinery import configurator, distributed
from machinery.data import chat, conversations, dataset, meta
from machinery.training import compile_trial, outdir, sdpa_backend, step_graph
from machinery.weights import checkpoint, convert, lora
from machinery.configurator import setting
from machinery.data.dataset import DATA_DIR
from machinery.errors import UserError, run_main
from machinery.training.evaluation import eval_due, save_due, split_losses
from machinery.hardware import (autocast, describe, device_setting, dtype_setting, enable_tf32, grad_scaler,
                                peak_flops, pick_dtype)
from machinery.training.metrics import Metrics
from machinery.training.nonfinite import NonFinite
from machinery.training.scoring import TrainingHellaSwag
from model import GPT, GPTConfig
from optimizers import POLAR_EXPRESS, build_optimizer, set_schedule


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = setting("out", "directory for checkpoints (ckpt.pt: latest state, best.pt: best val weights)")
    eval_interval: int = setting(2000, "evaluate train/val loss every this many iterations")
    log_interval: int = setting(1, "print a training log line every this many iterations")
    eval_iters: int = setting(200, "batches per split in each evaluation")
    eval_only: bool = setting(False, "evaluate once and exit")
    eval_at_start: bool = setting(True, "evaluate before the first step too (False saves that time, e.g. in a speedrun)")
    eval_whole_val: bool = setting(False, "val loss over the whole val split, in order (exact), not eval_iters batches")
    hellaswag_interval: int = setting(0, "HellaSwag acc_norm every this many steps and at the last (a multiple of "
                                         "eval_interval; 0: off; GPT-2 BPE data only)")
    hellaswag: str = setting("auto", "HellaSwag data for hellaswag_interval: a hellaswag_val.jsonl, or auto (download)")
    always_save_checkpoint: bool = setting(True, "write ckpt.pt at every evaluation, not only when val loss improves")
    ckpt_interval: int = setting(1000, "also write ckpt.pt every this many iterations (0: only at evals and the end)")
    init_from: str = setting("scratch", "scratch (new model), resume (out_dir/ckpt.pt), or GPT-2 weights to "
                                        "finetune: gpt2[-medium|-large|-xl] (Hugging Face cache) or a GPT-2 directory")
    # wandb
    wandb_log: bool = setting(False, "log to Weights & Biases")
    wandb_project: str = setting("owt", "wandb project name")
    wandb_run_name: str = setting("gpt2", "wandb run name")
    # data
    dataset: str = setting("openwebtext", "dataset name (DATA_DIR/DATASET) or a directory path: {train,val}.bin or "
                                          "llm.c shards *_{train,val}_*.bin")
    data_dir: str = setting(DATA_DIR, "directory holding the datasets")
    gradient_accumulation_steps: int = setting(40, "micro-batches per optimizer step, over all processes together")
    batch_size: int = setting(12, "sequences per micro-batch per process")
    block_size: int = setting(1024, "context length in tokens")
    chat_loss: str = setting("assistant", "on a chat dataset, the loss on the assistant's tokens (assistant) or on "
                                          "every token (all)")
    # model
    n_layer: int = setting(12, "transformer blocks")
    n_head: int = setting(12, "attention heads per block")
    n_embd: int = setting(768, "embedding width (divisible by n_head)")
    dropout: float = setting(0.0, "dropout probability (0 for pretraining, 0.1+ for finetuning)")
    bias: bool = setting(False, "biases in Linear and LayerNorm layers")
    vocab_size: Optional[int] = setting(None, "vocabulary size (None: the dataset's; GPT-2 BPE padded to 50304)")
    gelu: str = setting("auto", "GELU approximation: none (exact), tanh (GPT-2's), or auto: exact for a new model, "
                                "the weights' own when resuming or finetuning")
    qk_norm: bool = setting(False, "normalise each head's queries and keys (QK-norm; steadier with Muon)")
    mlp_ratio: int = setting(4, "the MLP's hidden width in multiples of n_embd (GPT-2: 4)")
    # LoRA (machinery/weights/lora.py): train low-rank adapters on the linear layers, every weight of the model frozen
    lora_rank: int = setting(0, "LoRA: the adapters' rank (0: no LoRA, every weight trains)")
    lora_alpha: float = setting(16.0, "LoRA: the adapters' output is scaled by lora_alpha / lora_rank")
    lora_dropout: float = setting(0.0, "LoRA: dropout on the adapters' input")
    lora_targets: str = setting("attn,proj,mlp", "LoRA: the layers given adapters, a comma list of attn (the q/k/v "
                                                 "projection), proj (attention's output) and mlp (both MLP layers)")
    # optimizer
    optimizer: str = setting("adamw", "adamw, or muon: Muon on the blocks' matrices, AdamW on the rest")
    learning_rate: float = setting(6e-4, "peak learning rate (AdamW's)")
    muon_lr: float = setting(0.02, "optimizer=muon: Muon's peak learning rate (follows the same schedule)")
    muon_momentum: float = setting(0.95, "optimizer=muon: Muon's Nesterov momentum")
    muon_momentum_warmup: int = setting(0, "optimizer=muon: steps in which Muon's momentum rises 0.85 -> muon_momentum")
    muon_ns_steps: int = setting(5, "optimizer=muon: Newton-Schulz steps, 1 to 5 (Polar Express's coefficients)")
    max_iters: int = setting(600000, "optimizer steps in total")
    weight_decay: float = setting(1e-1, "AdamW weight decay (matrices and embeddings only)")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip gradients at this global norm (0: no clipping)")
    # learning rate schedule
    decay_lr: bool = setting(True, "cosine decay after warmup (False: constant learning_rate)")
    warmup_iters: int = setting(2000, "linear warmup steps")
    lr_decay_iters: int = setting(600000, "step at which the cosine reaches min_lr (about max_iters)")
    min_lr: float = setting(6e-5, "final learning rate (about learning_rate / 10)")
    # system
    device: str = device_setting()
    dtype: str = dtype_setting()
    compile: Optional[bool] = setting(None, "torch.compile the model (None: on for CUDA)")
    cuda_graph: Optional[bool] = setting(None, "run each training step as one captured CUDA graph (None: on for CUDA "
                                               "in one process where it applies; machinery/training/step_graph.py)")
    sdpa_backend: str = setting("auto", "training's attention kernel: auto (PyTorch's choice), flash, cudnn, "
                                        "efficient or math (refused where it cannot run; machinery/training/sdpa_backend.py)")
    parallel: str = setting("ddp", "under torchrun: ddp (replicate the model) or fsdp (shard it)")
    seed: int = setting(1337, "random seed")

    def model_settings(self, given_only=False):
        """The model settings (every GPTConfig field is a setting of the same name), without those left to the
        model: None (vocab_size: the dataset's) and auto (gelu); given_only: only those a config file or the
        command line set (what a resume checks: a default is not a request)."""
        names = configurator.given(self) if given_only else {f.name for f in fields(self)}
        return {f.name: getattr(self, f.name) for f in fields(GPTConfig)
                if f.name in names and getattr(self, f.name) not in (None, "auto")}

    def gpt_config(self, vocab_size):
        """The new model these settings ask for (what they leave to the model: GPTConfig's defaults)."""
        return GPTConfig(**self.model_settings() | {"vocab_size": vocab_size})

    def validate(self):
        """One-line errors for impossible settings, before anything starts (the model's own: GPTConfig)."""
        configurator.check_positive(self, "eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps",
                                    "batch_size", "learning_rate", "muon_lr")
        configurator.check_not_negative(self, "max_iters", "warmup_iters", "lr_decay_iters", "ckpt_interval",
                                        "hellaswag_interval", "muon_momentum_warmup")
        if not 0 <= self.muon_momentum < 1:
            raise UserError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.min_lr < 0 or self.min_lr > self.learning_rate:
            raise UserError(f"min_lr must be between 0 and learning_rate, got {self.min_lr}")
        configurator.check_choice(self, optimizer=("adamw", "muon"), parallel=("ddp", "fsdp"),
                                  chat_loss=conversations.LEARN, muon_ns_steps=range(1, len(POLAR_EXPRESS) + 1),
                                  sdpa_backend=sdpa_backend.CHOICES)
        try:
            # (the vocabulary is the dataset's, not known yet: GPT-2's stands in)
            self.gpt_config(self.vocab_size or meta.DatasetMeta.gpt2().model_vocab_size).validate()
        except ValueError as e:
            raise UserError(str(e)) from None
        lora.LoRASettings.of(self)  # (one-line errors)
        step_graph.check_setting(self)
        if self.init_from not in ("scratch", "resume"):
            convert.find_pretrained(self.init_from)  # GPT-2 weights: a clear error for a bad name or path


def main(argv=None):
    cfg = configurator.parse(TrainConfig, argv, usage="python train.py [config/FILE.py ...] [--key=value ...]")
    cfg.validate()
    finished, trainer = False, None
    try:
        trainer = Trainer(cfg)
        trainer.train()
        finished = True
    finally:
        del trainer  # (before leaving the process group: see distributed.teardown)
        distributed.teardown(finished)


class Trainer:
    """One training run in this process: the model, its optimizer, the data, and the loop."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.world, self.device = distributed.setup(cfg.device)
        self.device_type = self.device.split(":")[0]
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.autocast = autocast(self.device, self.dtype)
        self.log = print if self.world.is_master else (lambda *a, **k: None)
        self.accum = distributed.micro_steps(cfg.gradient_accumulation_steps, self.world)  # on this rank
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.dataset = conversations.load(dataset.resolve(cfg.data_dir, cfg.dataset), cfg.block_size, cfg.chat_loss)
        self.data_meta = self.dataset.data_meta
        # chat data: a step's loss is the mean over all its target tokens, not over its micro-batches (None: those)
        self.token_mean = conversations.token_mean(self.dataset, self.accum, cfg.batch_size, self.world, self.device)
        self.hellaswag = TrainingHellaSwag(cfg, self.data_meta, self.device, self.autocast, self.log, self.world)
        enable_tf32(self.device_type)

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        ckpt = checkpoint.load(f"{cfg.out_dir}/{checkpoint.LATEST}") if cfg.init_from == "resume" else None
        model = self._build_model(ckpt)
        # LoRA: adapters on the model, now a frozen base (a resumed LoRA run's came back with its weights)
        # (a chat format's special tokens, which GPT-2 never learned, train with the adapters)
        self.lora = ckpt.lora_record if ckpt else lora.attach(model, cfg, chat.special_ids(self.data_meta.chat))
        self.raw_model = model.to(self.device)
        self.model_config = self.raw_model.config
        if self.dataset.check_token_ids(self.model_config.vocab_size):
            self.log(f"checked every token id of {self.dataset.directory}: no meta.json describes its files as they "
                     f"are now")
        # the attention kernel training runs (sdpa_backend), refused here if it cannot run this model's attention
        self.attention = sdpa_backend.for_training(cfg.sdpa_backend, self.raw_model, cfg.batch_size, cfg.block_size,
                                                   self.device, self.dtype)
        if self.world.distributed and cfg.parallel == "fsdp":
            distributed.shard(self.raw_model)
        self.use_compile = cfg.compile if cfg.compile is not None else self.device_type == "cuda"
        self.optimizer = build_optimizer(self.raw_model, cfg.optimizer, cfg.learning_rate, cfg.weight_decay,
                                         (cfg.beta1, cfg.beta2), self.device_type, muon_lr=cfg.muon_lr,
                                         muon_ns_steps=cfg.muon_ns_steps, compile=self.use_compile)
        self.scaler = grad_scaler(self.device_type, self.dtype)  # float16's; a no-op for other dtypes
        self.nonfinite = NonFinite(self.device, cfg.out_dir)  # marked on the device, checked when logging/saving
        self.train_sampler = self._sampler()
        self.batch_state = self.train_sampler.state_dict()  # (the sampler's state before the batch fetched last)
        distributed.seed_rank(cfg.seed, self.world)  # dropout differs between ranks
        self.iter_num, self.best_val_loss, self.wandb_run_id, self.saved_at = 0, float("inf"), None, {}
        self.resumed_from, self.metrics = None, None  # (the metrics are opened when training starts)
        self.flops_peak, self.running_mfu = peak_flops(self.device), -1.0  # for MFU, on GPUs we know
        if ckpt:
            self._restore(ckpt)
        self.model = self._wrap(self.raw_model)
        self.step_graph = step_graph.build(self)  # the step as one CUDA graph, where that applies (else None)
        # last, so that nothing after it can fail: out_dir is this run's until train() ends (or the process does)
        self.out_dir_lock = outdir.claim(cfg.out_dir) if self.world.is_master else None  # nothing written before

    def train(self):
        """The loop: evaluate (and checkpoint) every eval_interval steps, one optimizer step per
        iteration, a log line every log_interval, a checkpoint every ckpt_interval and at the end."""
        cfg = self.cfg
        self.log(f"tokens per iteration: {self.tokens_per_iter:,} ({self.world.size} process(es) x {self.accum} "
                 f"micro-steps x {cfg.batch_size} x {cfg.block_size})")
        self.log(f"parameters: {self.raw_model.get_num_params() / 1e6:.2f}M; {describe(self.device, self.dtype)}")
        self.log(f"attention: {self.attention}")
        if self.lora:
            self.log(lora.trainable_line(self.raw_model, self.lora))
        self.metrics = Metrics(cfg, self.resumed_from, eval_due(self.iter_num, 0, cfg), self.wandb_run_id) \
            if self.world.is_master else None
        self.wandb_run_id = (self.metrics and self.metrics.wandb_run_id) or self.wandb_run_id
        stop = distributed.StopFlag(self.world.launcher)
        try:
            x, y = self.next_batch()
            t0, local_iter, since = time.time(), 0, 0  # (since: iterations since t0, the last line's time)
            while True:
                lr = set_schedule(self.optimizer, self.iter_num, cfg)
                if eval_due(self.iter_num, local_iter, cfg):
                    self.evaluate_and_checkpoint(lr)
                    if cfg.eval_only:
                        break
                    t0, since = time.time(), 0  # evaluation time is not training time
                if self.iter_num >= cfg.max_iters:
                    break

                loss, x, y = self.optimizer_step(x, y)
                self.iter_num += 1
                local_iter += 1
                since += 1
                logs = self.iter_num % cfg.log_interval == 0
                if logs and self.world.is_master:
                    t0, since = self.log_iteration(loss, t0, since, lr, local_iter), 0
                # saving never waits for an evaluation: every ckpt_interval steps, on a signal, and right after
                # the last step (before the final evaluation, which could fail). Under torchrun, asking the other
                # ranks about signals syncs with the device: only on steps that log (which sync anyway).
                stopping = stop.requested(self.world, self.device, ask_ranks=logs)
                if stopping or save_due(self.iter_num, cfg):
                    self.save(checkpoint.LATEST)
                if stopping:
                    self.log(f"stopped by {stop.name} at iteration {self.iter_num}; checkpoint saved in "
                             f"{cfg.out_dir}/{checkpoint.LATEST}. Resume with the same command and --init_from=resume")
                    break
            if not cfg.eval_only and self.saved_at.get(checkpoint.LATEST) != self.iter_num:
                self.save(checkpoint.LATEST)  # the final state, whatever the evaluation said
        finally:
            stop.restore()
            if self.metrics:
                self.metrics.close()
            if self.out_dir_lock:
                self.out_dir_lock.release()

    def evaluate_and_checkpoint(self, lr):
        """Losses (and HellaSwag when due), logged; best.pt if val improves, ckpt.pt as always_save_checkpoint asks."""
        cfg = self.cfg
        self.nonfinite.check(sync=True)
        losses = self.estimate_loss()
        self.log(f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        self.nonfinite.check_val(losses["val"], self.iter_num)
        hellaswag = self.hellaswag(self.iter_num, self.raw_model)  # (every rank: the examples are split over them)
        if self.metrics:
            mfu = {"mfu": self.running_mfu * 100} if self.running_mfu >= 0 else {}  # -1 until measured (GPUs)
            self.metrics.record(self.iter_num, train_loss=losses["train"], val_loss=losses["val"], lr=lr,
                                tokens=self.iter_num * self.tokens_per_iter, **mfu, **hellaswag)
        if cfg.eval_only:
            return
        improved = losses["val"] < self.best_val_loss
        if improved:
            self.best_val_loss = losses["val"]
            if self.iter_num > 0:
                self.save(checkpoint.BEST)
        # (again when improved, even if just saved: ckpt.pt keeps best_val_loss for a resumed run)
        if self.iter_num > 0 and (improved or (cfg.always_save_checkpoint
                                               and self.saved_at.get(checkpoint.LATEST) != self.iter_num)):
            self.save(checkpoint.LATEST)

    def optimizer_step(self, x, y):
        """One optimizer step: accum micro-batches on this rank, the first being (x, y); gradients are
        synchronised across ranks only on the last one. Returns the last micro-batch's loss (divided by
        accum; on chat data the step's loss) and the next batch, fetched while the device works. With
        cuda_graph, the same step replayed as one CUDA graph (machinery/training/step_graph.py)."""
        if self.step_graph and self.step_graph.ready():
            return self.step_graph.step(x, y)
        for micro_step in range(self.accum):
            last = micro_step == self.accum - 1
            with distributed.gradient_sync(self.model, self.raw_model, self.world, self.cfg.parallel, last):
                loss = self.micro_step(x, y, self.iter_num + 1)
            x, y = self.next_batch()
        loss = self.update(loss)
        self.optimizer.zero_grad(set_to_none=True)
        return loss, x, y

    def micro_step(self, x, y, iteration):
        """One micro-batch's forward and backward; returns its loss. A non-finite loss is marked on the device as
        step `iteration` (an int, or a captured step's tensor), numbered as the `iter N:` log line of this step."""
        with self.autocast, self.attention:
            _, loss = self.model(x, y)
            # the mean over micro-steps (DDP averages over ranks); chat data: weighed by its targets
            loss = loss / self.accum if self.token_mean is None else self.token_mean.weigh(loss, y)
        if not self.scaler.is_enabled():  # with fp16 the GradScaler skips bad steps instead
            self.nonfinite.mark(loss, iteration)
        self.scaler.scale(loss).backward()
        return loss

    def update(self, loss):
        """After the last micro-step: clip the gradients, step the optimizer; returns the step's loss."""
        if self.token_mean is not None:
            loss = self.token_mean.finish(self.raw_model)  # the gradients scaled to the step's mean, and its loss
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss

    def log_iteration(self, loss, t0, iters, lr, local_iter):
        """The `iter N:` line, its time the mean of the iters iterations since t0, read once the device is done (a
        captured step runs ahead of the host: one step's host time says nothing). Returns the time it read."""
        self.nonfinite.check()
        # the last micro-batch's loss, or a chat step's (syncs with the device)
        lossf = loss.item() * (self.accum if self.token_mean is None else 1)
        t1 = time.time()
        dt = (t1 - t0) / iters
        line = f"iter {self.iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, tok/s {self.tokens_per_iter / dt:,.0f}"
        if self.flops_peak and local_iter >= 5:  # skip the first iterations (compilation, warm-up)
            mfu = self.raw_model.estimate_mfu(self.cfg.batch_size * self.accum, dt, self.flops_peak)  # per device
            self.running_mfu = mfu if self.running_mfu < 0 else 0.9 * self.running_mfu + 0.1 * mfu
            line += f", mfu {self.running_mfu * 100:.2f}%"
        self.log(line)
        self.metrics.record(self.iter_num, loss=lossf, lr=lr, tokens=self.iter_num * self.tokens_per_iter,
                            tokens_per_s=round(self.tokens_per_iter / dt))
        return t1

    def estimate_loss(self):
        """The train and val losses now (split_losses), from the training batches' stream as nanoGPT's."""
        return split_losses(self.model, self.dataset, self.train_sampler.generator, self.cfg, self.device,
                            self.autocast, self.attention, self.world)

    def save(self, which):
        """Write ckpt.pt (full state) or best.pt (weights); every rank must call it (state is gathered)."""
        self.nonfinite.check(sync=True)
        weights = checkpoint.model_state(self.raw_model)
        self.nonfinite.check_weights(weights, self.iter_num)
        state = checkpoint.training_state(weights, self.model_config, self.cfg, self.data_meta, self.iter_num,
                                          self.best_val_loss, self.lora)
        if which == checkpoint.LATEST:
            # the sampler state from before the batch already fetched, so a resumed run fetches it again
            ranks = distributed.gather_objects(checkpoint.rank_state(self.batch_state), self.world)
            state = checkpoint.resume_state(state, checkpoint.optimizer_state(self.raw_model, self.optimizer),
                                            self.scaler.state_dict(), ranks, self.wandb_run_id)
        if self.world.is_master:
            path = f"{self.cfg.out_dir}/{which}"
            checkpoint.save(state, path)
            if self.lora:  # (LoRA saves the adapters, and in ckpt.pt their optimizer state: megabytes for GPT-2)
                self.log(f"saved {path}: {os.path.getsize(path) / 1e6:.2f} MB")
        self.saved_at[which] = self.iter_num

    def next_batch(self):
        self.batch_state = self.train_sampler.state_dict()
        return self.train_sampler.next()

    # -- setup

    def _build_model(self, ckpt):
        """A new model (scratch), the checkpoint's (resume), or GPT-2's weights to finetune."""
        cfg = self.cfg
        if cfg.init_from not in ("scratch", "resume"):
            model = convert.load_for_finetune(cfg.init_from, self.data_meta, cfg.dataset, cfg.block_size, cfg.dropout)
            mc = self._settings_from(model.config)
            self.log(f"initialized from {cfg.init_from}: n_layer={mc.n_layer}, n_head={mc.n_head}, n_embd={mc.n_embd}, "
                     f"vocab_size={mc.vocab_size}, block_size={mc.block_size}, bias={mc.bias}, gelu={mc.gelu}")
            return model
        if ckpt is None:
            vocab = cfg.vocab_size or self.data_meta.model_vocab_size  # (GPT-2 BPE: padded, meta.py)
            if vocab < self.data_meta.vocab_size:
                raise UserError(f"vocab_size {vocab} is smaller than the dataset's vocabulary "
                                f"({self.data_meta.vocab_size})")
            return GPT(cfg.gpt_config(vocab))
        ckpt.check_resume(cfg, self.data_meta)
        mc = ckpt.model_config
        for name in checkpoint.PER_RUN:  # (dropout) may change on resume
            setattr(mc, name, getattr(cfg, name))
        model = GPT(self._settings_from(mc))
        ckpt.load_weights(model)
        return model

    def _settings_from(self, model_config):
        """The model settings a finetune's weights or a resumed checkpoint decide (all but block_size and
        dropout: gelu, vocab_size, ...) written into cfg, so that the train_config checkpoints record tells the
        truth; returns model_config."""
        for name in {f.name for f in fields(GPTConfig)} - {"block_size", *checkpoint.PER_RUN}:
            setattr(self.cfg, name, getattr(model_config, name))
        return model_config

    def _sampler(self):
        """The training batches continue torch's random stream from just after the model's initialisation,
        where nanoGPT's get_batch draws them (other ranks: a stream of their own). So nanoGPT's config and seed
        give nanoGPT's run: the same initial weights, the same batches, the same losses (README, Results)."""
        generator = torch.Generator()
        if self.world.rank == 0:
            generator.set_state(torch.get_rng_state())
        else:
            generator.manual_seed(self.cfg.seed + 1000 * self.world.rank + 1)
        return conversations.batch_sampler(self.dataset.train, self.cfg.batch_size, self.cfg.block_size, generator,
                                           self.device)

    def _restore(self, ckpt):
        checkpoint.load_optimizer_state(self.raw_model, self.optimizer, ckpt.optimizer_state,
                                        sharded=self.world.distributed and self.cfg.parallel == "fsdp")
        self.iter_num, self.best_val_loss, self.wandb_run_id = ckpt.iter_num, ckpt.best_val_loss, ckpt.wandb_run_id
        self.resumed_from = self.iter_num
        if ckpt.scaler_state and self.scaler.is_enabled():
            self.scaler.load_state_dict(ckpt.scaler_state)
        distributed.check_resumed_together(self.iter_num, ckpt.restore_rank(self.world, self.train_sampler), self.world,
                                           ckpt.path, self.log)
        self.log(f"resuming from {self.cfg.out_dir}/{checkpoint.LATEST} at iteration {self.iter_num}")

    def _wrap(self, model):
        """DDP's replicas under torchrun, then torch.compile where the run compiles (unless the compiler fails)."""
        if self.world.distributed and self.cfg.parallel == "ddp":
            model = distributed.replicate(model, self.world, self.device_type)
        if not self.use_compile:
            return model
        return compile_trial.compiled_or_eager(model, self.train_sampler, self.optimizer, self.autocast,
                                               self.attention, self.log)


if __name__ == "__main__":
    run_main(main)
