"""
Loading other people's files without running their code.

PyTorch checkpoints are pickles, and unpickling can call any function. torch_load reads
them with torch.load(weights_only=True), which builds only tensors and plain data and
refuses anything else; this module turns what can go wrong (a damaged file, a file that
asks for code) into one clear line.

nanoGPT's data/<dataset>/meta.pkl is a plain pickle of a dict (vocab_size, itos, stoi).
read_plain_pickle unpickles with a find_class that refuses every import: only what pickle
encodes directly (dict, list, tuple, set, str, bytes, int, float, bool, None) can load,
and a file that asks for anything else is refused before any of it runs.
"""

import io
import pickle
import re
import zipfile

from machinery.errors import UserError, first_line

# what the weights_only unpickler says when a file asks it to build an object or call a function
_UNSAFE_SIGNS = ("GLOBAL", "unrecognized function", "Can only create new object", "Can only build")


def torch_load(path):
    """torch.load a file of tensors and plain data (weights_only=True) onto the CPU; one-line errors."""
    import torch  # here, not at the top: prepare.py reads meta.pkl through this module and needs no torch
    # (importing it costs ~2 s and ~220 MB in prepare.py and in every worker process it forks)

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


class _Refused(Exception):
    """The pickle asks for more than plain data."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        # every way a pickle reaches a callable (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*) goes through here
        raise _Refused(f"it asks to import {module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("it uses persistent ids")


def read_plain_pickle(path):
    """The plain data (dicts, lists, strings, numbers) pickled in path; anything that would import is refused."""
    try:
        with open(path, "rb") as f:
            return _PlainUnpickler(io.BytesIO(f.read())).load()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror})") from None
    except _Refused as e:
        raise UserError(f"refusing to load {path}: {e}, and it should hold only plain data (nothing in it was "
                        f"run); use a file from a source you trust") from None
    except Exception as e:  # truncated or not a pickle at all: EOFError, ValueError, ...
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}); prepare the dataset again") from None
