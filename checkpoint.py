"""
Checkpoints: saving them so that no crash can corrupt one, loading them without
running anyone's code, and rebuilding the model they hold.

out_dir/ckpt.pt   the latest full training state, for init_from=resume
out_dir/best.pt   the weights with the best validation loss, for sampling

Both are plain dicts of tensors, numbers, strings, lists and dicts, so they load
with torch.load(..., weights_only=True): a file that carries anything else (a
pickled object that would run code) is refused.
"""

import os
import pickle
import re
import zipfile
from dataclasses import fields

import torch

from configurator import UserError
from model import GPT, GPTConfig

LATEST = "ckpt.pt"
BEST = "best.pt"


def save(state, path):
    """Write state to path atomically: a temporary file in the same directory, flushed and
    fsynced, then renamed over the old file. A process killed at any instant leaves either
    the old complete checkpoint or the new complete one, never a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f"{_temp_prefix(path)}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:  # a full disk, a quota, a vanished directory: the old checkpoint is still whole
        raise UserError(f"cannot write checkpoint {path} ({e.strerror or e}); the previous one is intact; "
                        f"free some space (or fix --out_dir) and resume with --init_from=resume") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _temp_prefix(path):
    return f".{os.path.basename(path)}.tmp."


def remove_stale_temps(out_dir):
    """Delete temporary files that a killed process left half-written (they can be gigabytes each)."""
    prefixes = tuple(_temp_prefix(which) for which in (LATEST, BEST))
    for name in os.listdir(out_dir):
        if name.startswith(prefixes):
            os.remove(os.path.join(out_dir, name))


def load(path):
    """Load a checkpoint dict safely (weights_only=True) onto the CPU; clear errors for bad files.
    nanoGPT's ckpt.pt (model_args, its own weight names) comes back in this repository's layout."""
    ckpt = read(path)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise UserError(f"{path} is not a model checkpoint (no 'model' weights in it)")
    if "model_args" in ckpt and "model_config" not in ckpt:
        import convert  # only for nanoGPT's checkpoints

        ckpt = convert.from_nanogpt(ckpt, path)
    return ckpt


def read(path):
    """torch.load a file of tensors and plain data (weights_only=True) onto the CPU; clear errors for bad files."""
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory, not a checkpoint file")
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} not found; train first (python train.py ...) or check --out_dir")
    corrupt = f"checkpoint {path} is truncated or corrupt"
    # torch.save has written zip files since PyTorch 1.6; anything else is damaged or not a checkpoint
    if not zipfile.is_zipfile(path):
        raise UserError(f"{corrupt} (not a PyTorch zip archive); use another checkpoint or train again")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if any(sign in str(e) for sign in _UNSAFE_SIGNS):
            named = re.search(r"GLOBAL (\S+)", str(e))  # the function or class it asks for, e.g. posix.system
            raise UserError(f"refusing to load {path}: it holds Python objects beyond tensors and plain data"
                            f"{f' ({named[1]})' if named else ''}, which could run code when loaded; only load "
                            f"checkpoints you trust") from None
        # (torch's own message suggests weights_only=False: not advice to pass on for a damaged file)
        raise UserError(f"{corrupt} (its data cannot be unpickled); use another checkpoint or train again") from None
    except Exception as e:  # a damaged file fails in many ways inside torch.load
        raise UserError(f"{corrupt} ({_first_line(e)}); use another checkpoint or train again") from None
    return ckpt


# what the weights_only unpickler says when a file asks it to build an object or call a function
_UNSAFE_SIGNS = ("GLOBAL", "unrecognized function", "Can only create new object", "Can only build")


def _first_line(e):
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def strip_prefix(state_dict, prefix="_orig_mod."):
    """Weights of a torch.compile'd model carry an `_orig_mod.` prefix; drop it."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}


def model_config(ckpt):
    """The GPTConfig a checkpoint was trained with."""
    known = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in ckpt["model_config"].items() if k in known})


def build_model(ckpt):
    """A GPT with the checkpoint's weights (on the CPU)."""
    try:
        model = GPT(model_config(ckpt))
    except (ValueError, TypeError) as e:
        raise UserError(f"the checkpoint's model config is invalid: {e}") from None
    load_weights(model, ckpt)
    return model


def load_weights(model, ckpt):
    """Copy the checkpoint's weights into model, with a clear error when they do not fit."""
    state = strip_prefix(ckpt["model"])
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise UserError(f"the checkpoint's weights do not fit the model: {_first_line(e)}") from None
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to tok_emb.weight
    if missing or unexpected:
        raise UserError(f"the checkpoint's weights do not match the model: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")


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
