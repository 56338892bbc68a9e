"""
Loading other people's files without running their code.

PyTorch checkpoints are pickles, and unpickling can call any function. torch_load reads
them with torch.load(weights_only=True), which builds only tensors and plain data and
refuses anything else; this module turns what can go wrong (a damaged file, a file that
asks for code) into one clear line.
"""

import pickle
import re
import zipfile

import torch

from errors import UserError, first_line

# what the weights_only unpickler says when a file asks it to build an object or call a function
_UNSAFE_SIGNS = ("GLOBAL", "unrecognized function", "Can only create new object", "Can only build")


def torch_load(path):
    """torch.load a file of tensors and plain data (weights_only=True) onto the CPU; one-line errors."""
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
