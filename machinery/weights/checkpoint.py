"""
Checkpoints: what they hold, writing them so that no crash can corrupt one (save), and reading them (ours and
nanoGPT's) without running anyone's code (torch_load). Other modules ask a loaded Checkpoint for what they need;
only this file knows the keys of the dict on disk.

out_dir/ckpt.pt   the latest full training state, for init_from=resume
out_dir/best.pt   the weights with the best validation loss, for sampling

    model, model_config, train_config, iter_num, best_val_loss, meta (the dataset's tokenizer)
    ckpt.pt also: optimizer, scaler, ranks (per process: every RNG and the batch sampler), wandb_run_id
    a LoRA run's: model holds only the adapters (the optimizer only theirs), and lora its settings and its base

Not here: rebuilding a LoRA run's base (lora.py), GPT-2's weights (gpt2_weights.py), the training loop (train.py).
"""

import os
import pickle
import random
import re
import zipfile
from dataclasses import asdict, fields

import numpy as np
import torch

from machinery.data import meta
from machinery.weights import lora
from machinery.errors import UserError, first_line
from machinery.fileio import atomic_write
from machinery.gpt2_weights import from_gpt2_layout
from model import GPT, GPTConfig

LATEST = "ckpt.pt"
BEST = "best.pt"
# GPTConfig's fields that a run may change when it resumes or finetunes a model: the weights do not depend on them
# (every other field must match on resume, a new one included)
PER_RUN = ("dropout",)
NOT_IN_NANOGPT = ("gelu", "qk_norm", "mlp_ratio")  # GPTConfig's fields nanoGPT's has not (its models: the defaults)


class Checkpoint:
    """A checkpoint read from disk (see load)."""

    def __init__(self, state, path):
        self._state, self.path = state, path

    @property
    def model_config(self):
        """The GPTConfig the checkpoint was trained with."""
        saved = self._state["model_config"]
        unknown = sorted(set(saved) - {f.name for f in fields(GPTConfig)})
        if unknown:
            raise UserError(f"{self.path} has model settings this model.py does not know ({', '.join(unknown)}); "
                            f"it was written by another version of the code")
        config = GPTConfig(**saved)
        try:
            config.validate()
        except ValueError as e:
            raise UserError(f"the model config in {self.path} is invalid: {e}") from None
        return config

    def build_model(self):
        """A GPT with the checkpoint's weights, on the CPU (a LoRA run's: its base with the adapters merged in),
        built without drawing initial weights first (GPT.with_weights)."""
        if self.lora_record:
            adapters = self.adapters
            return lora.merged_model(self.lora_record, self.model_config, adapters, self.path)
        config = self.model_config
        try:
            return GPT.with_weights(config, self._state["model"])  # (straight from the config's check: one visit)
        except ValueError as e:
            raise UserError(f"the checkpoint's {e}") from None

    def load_weights(self, model):
        """Put the checkpoint's weights into model (a LoRA run's: its base's, and the adapters, unmerged)."""
        if self.lora_record:
            fitting(model.load_weights, lora.build_base(self.lora_record, model.config, self.path).state_dict())
            lora.load_adapters(model, self.lora_record, self.adapters, self.path)
        else:
            fitting(model.load_weights, self._state["model"])

    lora_record = property(lambda self: self._state.get("lora"), doc="A LoRA run's settings and base (else None).")

    @property
    def adapters(self):
        """A LoRA run's adapters (lora_A and lora_B of each targeted layer), by our names."""
        if not self.lora_record:
            raise UserError(f"{self.path} holds a whole model, not LoRA adapters (it was trained without "
                            f"--lora_rank)")
        return self._state["model"]

    @property
    def data_meta(self):
        """The dataset metadata (tokenizer) it was trained with; None in nanoGPT's checkpoints."""
        saved = self._state.get("meta") or self._state.get("tokenizer")  # "tokenizer": our earlier name
        return meta.DatasetMeta.from_dict(saved, self.path) if saved else None

    @property
    def dataset(self):
        """The dataset name of its training settings (nanoGPT's checkpoints call them config)."""
        settings = self._state.get("train_config") or self._state.get("config") or {}
        return settings.get("dataset")

    iter_num = property(lambda self: self._state["iter_num"])
    best_val_loss = property(lambda self: self._state.get("best_val_loss", float("inf")))
    wandb_run_id = property(lambda self: self._state.get("wandb_run_id"))
    optimizer_state = property(lambda self: self._state["optimizer"])
    scaler_state = property(lambda self: self._state.get("scaler"))

    def restore_rank(self, world, sampler):
        """Put this rank's RNGs and batch sampler back where they were saved, when the checkpoint was written
        by as many processes; returns how many wrote it (None: it does not say, as nanoGPT's)."""
        ranks = self._state.get("ranks")
        if ranks and len(ranks) == world.size:
            restore_rank_state(ranks[world.rank], sampler)
        return len(ranks) if ranks else None

    def check_resume(self, cfg, data_meta):
        """Refuse to resume with other model settings or on data with other tokens."""
        mc = self.model_config
        # every model setting a config file or the command line gives must match, except those a run may change
        # (PER_RUN); the settings left at their defaults, None or auto take the checkpoint's
        for name, asked in cfg.model_settings(given_only=True).items():
            if name not in PER_RUN and asked != getattr(mc, name):
                raise UserError(f"{self.path} has {name}={getattr(mc, name)} but the config asks for {asked}; resume "
                                f"with the same model settings (or leave {name} out) or start from scratch")
        optimizer = (self._state.get("train_config") or {}).get("optimizer", "adamw")  # nanoGPT's: AdamW
        if optimizer != cfg.optimizer:
            raise UserError(f"{self.path} was trained with optimizer={optimizer}; resume with --optimizer={optimizer}")
        if mc.vocab_size < data_meta.vocab_size:
            raise UserError(f"{self.path} has vocab_size={mc.vocab_size} but dataset {cfg.dataset} needs "
                            f"{data_meta.vocab_size}; resume on the dataset it was trained on")
        lora.resume_settings(self.lora_record, cfg, self.path)
        if self.data_meta is not None and not self.data_meta.same_tokens(data_meta):
            raise UserError(f"{self.path} was trained on data with other tokens ({self.data_meta.tokenizer} with a "
                            f"different character vocabulary) than dataset {cfg.dataset}; resume on the dataset "
                            f"it was trained on")


# ---------------------------------------------------------------------- building and saving


def fitting(load, *args):
    """load(*args) (a model's load_weights), a one-line error when the weights do not fit."""
    try:
        return load(*args)
    except ValueError as e:
        raise UserError(f"the checkpoint's {e}") from None


def training_state(model_state, model_config, train_config, data_meta, iter_num, best_val_loss, lora_record=None):
    """What best.pt holds: the weights and what it takes to use them (a LoRA run's: the adapters and its record)."""
    state = {"model": model_state, "model_config": asdict(model_config), "train_config": asdict(train_config),
             "iter_num": iter_num, "best_val_loss": best_val_loss, "meta": data_meta.to_dict()}
    if lora_record:
        state.update(model=lora.adapter_state(model_state), lora=lora_record)
    return state


def resume_state(state, optimizer_state, scaler_state, rank_states, wandb_run_id):
    """What ckpt.pt holds besides: everything a resumed run needs to continue bit for bit."""
    return dict(state, optimizer=optimizer_state, scaler=scaler_state, ranks=rank_states,
                wandb_run_id=wandb_run_id)


def rank_state(sampler_state):
    """One process's share of ckpt.pt: every RNG (dropout, ...) and its batch sampler."""
    np_state = np.random.get_state()
    rng = {"python": random.getstate(),
           "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {"rng": rng, "sampler": sampler_state}


def restore_rank_state(state, sampler):
    """Undo what happened to the RNGs and the sampler since rank_state(sampler.state_dict())."""
    sampler.load_state_dict(state["sampler"])
    rng = state["rng"]
    random.setstate(_to_tuple(rng["python"]))
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():  # (written with more GPUs than here: the ones there are)
        torch.cuda.set_rng_state_all(rng["cuda"][:torch.cuda.device_count()])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def model_state(model):
    """Full weights on the CPU, gathered from every rank under FSDP (every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model, optimizer):
    """Full optimizer state on the CPU keyed by parameter name (every rank must call it). With model_state's full
    weights, a checkpoint written by any number of processes, with DDP or FSDP, resumes under any other and loads
    in a single-process sample.py."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state, sharded):
    """Put saved optimizer state into optimizer: ours (keyed by name) or nanoGPT's (keyed by position)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    groups = state.get("param_groups") or [{}]
    if groups[0].get("params") and isinstance(groups[0]["params"][0], int):
        # keyed by position: a plain optimizer.state_dict(), as nanoGPT writes (same parameter order)
        if sharded:
            raise UserError("this checkpoint's optimizer state is keyed by position (nanoGPT's format); "
                            "resume it once without FSDP (one process or --parallel=ddp), then with FSDP")
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    for group in optimizer.param_groups:  # the round trip turns tuples into lists; keep AdamW's own types
        if "betas" in group:
            group["betas"] = tuple(group["betas"])


def save(state, path):
    """Write state to path atomically: a process killed at any instant leaves either the old complete
    checkpoint or the new complete one, never a half-written file."""
    try:
        with atomic_write(path) as f:
            torch.save(state, f)
    except OSError as e:  # a full disk, a quota, a vanished directory: the old checkpoint is still whole
        raise UserError(f"cannot write checkpoint {path} ({e.strerror or e}); the previous one is intact; "
                        f"free some space (or fix --out_dir) and resume with --init_from=resume") from None


# ---------------------------------------------------------------------- finding and loading


def find(out_dir, which="best"):
    """Path of the checkpoint to sample from: best.pt by default, ckpt.pt when there is no best yet."""
    if os.path.isfile(out_dir):
        return out_dir  # a checkpoint file given directly
    best, latest = os.path.join(out_dir, BEST), os.path.join(out_dir, LATEST)
    if which == "best" and os.path.isfile(best):
        return best
    if os.path.isfile(latest) or which == "latest":
        return latest
    raise UserError(f"no checkpoint in {out_dir} ({BEST} or {LATEST}); train first or check --out_dir")


# what the weights_only unpickler says when a file asks it to build an object or call a function
_UNSAFE_SIGNS = ("GLOBAL", "unrecognized function", "Can only create new object", "Can only build")


def torch_load(path):
    """torch.load a file of tensors and plain data (weights_only=True) onto the CPU; one-line errors. Checkpoints
    are plain dicts of tensors, numbers, strings, lists and dicts, so weights_only builds only those: a file that
    asks for anything else (unpickling can call any function) is refused in one line, as is a damaged one."""
    corrupt = f"checkpoint {path} is truncated or corrupt"
    # torch.save has written zip files since PyTorch 1.6; anything else is damaged or not a checkpoint
    if not zipfile.is_zipfile(path):
        raise UserError(f"{corrupt} (not a PyTorch zip archive); use another checkpoint or train again")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if any(sign in str(e) for sign in _UNSAFE_SIGNS):
            named = re.search(r"GLOBAL (\S+)", str(e))  # the function or class it asks for, e.g. posix.system
            raise UserError(f"refusing to load {path}: it holds Python objects beyond tensors and plain data"
                            f"{f' ({named[1]})' if named else ''}, which could run code when loaded; only load "
                            f"checkpoints you trust") from None
        # (torch's own message suggests weights_only=False: not advice to pass on for a damaged file)
        raise UserError(f"{corrupt} (its data cannot be unpickled); use another checkpoint or train again") from None
    except Exception as e:  # a damaged file fails in many ways inside torch.load
        raise UserError(f"{corrupt} ({first_line(e)}); use another checkpoint or train again") from None


def load(path):
    """Read a checkpoint safely onto the CPU; nanoGPT's ckpt.pt comes back in this repository's layout."""
    path = str(path)
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory, not a checkpoint file")
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} not found; train first (python train.py ...) or check --out_dir")
    state = torch_load(path)
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} is not a model checkpoint (no 'model' weights in it)")
    if "model_args" in state and "model_config" not in state:
        state = _from_nanogpt(state, path)
    return Checkpoint(state, path)


def _from_nanogpt(state, path):
    """Our layout from nanoGPT's ckpt.pt (model_args, nanoGPT's weight names).

    The optimizer state is kept as it is: nanoGPT's configure_optimizers makes the same two
    groups as ours (matrices and embeddings, then biases and gains) over the same parameters
    in the same module order, so its entries line up with our parameters one to one.
    """
    args = state["model_args"]
    sizes = [f.name for f in fields(GPTConfig) if f.type is int and f.name not in NOT_IN_NANOGPT]
    if not isinstance(args, dict) or not set(sizes) <= args.keys():  # (the other fields have defaults)
        raise UserError(f"{path}: model_args must hold {', '.join(sizes[:-1])} and {sizes[-1]}")
    extra = sorted(set(args) - {f.name for f in fields(GPTConfig)} | set(args) & set(NOT_IN_NANOGPT))
    if extra:
        raise UserError(f"{path}: model_args has settings nanoGPT's GPT does not ({', '.join(extra)}); "
                        f"a modified nanoGPT's model cannot be loaded here")
    try:
        weights = from_gpt2_layout(state["model"], conv1d=False, source=path)
    except ValueError as e:
        raise UserError(str(e)) from None
    model_config = dict(args)  # the fields nanoGPT has not (exact GELU, MLP 4x wide, ...) keep GPTConfig's defaults
    out = dict(state, model=weights, model_config=model_config)
    if isinstance(out.get("best_val_loss"), torch.Tensor):  # nanoGPT stores it as a 0-d tensor
        out["best_val_loss"] = out["best_val_loss"].item()
    return out
