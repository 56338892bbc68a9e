"""
The attention kernel of training (train.py --sdpa_backend): PyTorch's own choice (auto, as before the setting), or
one of its scaled-dot-product kernels (flash, cudnn, efficient, math) made the only one PyTorch may pick for the
training forwards (their backward is that kernel's) and the evaluations' forwards. Owned here: the names, the check
before training that the asked kernel can run this run's attention (device, dtype, heads, length, dropout), refused
in one line where it cannot, and the name of the kernel that runs, for the log (PyTorch's own dispatch asked, for
this shape and dtype). Not owned: the attention itself (model.Head), decoding's kernels (model.attention_backends),
HellaSwag's scoring (PyTorch's choice).
"""

import warnings
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from machinery.errors import UserError
from machinery.hardware import DTYPES

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
CHOICES = ("auto", *BACKENDS)
_NAMES = {int(backend): name for name, backend in BACKENDS.items()}


class Attention:
    """The setting as a context, entered around each forward (whose backward follows the kernel it ran): the asked
    kernel the only one PyTorch may pick; auto changes nothing. runs: the name of the kernel training's runs."""

    def __init__(self, name, runs=None):
        self.name, self.runs, self._open = name, runs, []

    def __enter__(self):
        context = nullcontext() if self.name == "auto" else sdpa_kernel(BACKENDS[self.name])
        self._open.append(context)
        return context.__enter__()

    def __exit__(self, *exc):
        return self._open.pop().__exit__(*exc)

    def __str__(self):
        """What the log says: the kernel, and for auto that PyTorch chose it."""
        return self.runs if self.name != "auto" else f"{self.runs} (sdpa_backend=auto: PyTorch's choice)"


def for_training(name, model, batch_size, block_size, device, dtype):
    """The Attention of setting name for training model (its heads, dropout, weights' dtype) in batches of
    batch_size x block_size on device with dtype (the setting); a one-line UserError where the asked kernel
    cannot run that attention."""
    config = model.config
    shape = (batch_size, config.n_head, block_size, config.n_embd // config.n_head)
    # (B, heads, T, head size) in autocast's dtype on CUDA; on a CPU model.Head computes in the weights' (float32)
    qkv_dtype = DTYPES[dtype] if device.startswith("cuda") and dtype != "float32" else next(model.parameters()).dtype
    runs = picked(name, shape, device, qkv_dtype, config.dropout)
    if name == "auto":
        return Attention(name, runs or "not known on this device")
    if runs is None:
        can = [other for other in BACKENDS if picked(other, shape, device, qkv_dtype, config.dropout)]
        raise UserError(f"sdpa_backend={name} cannot run this training's attention on {device} "
                        f"({str(qkv_dtype).removeprefix('torch.')}, {shape[1]} heads of size {shape[3]} over "
                        f"{block_size} positions, dropout {config.dropout}); what can: {', '.join(can + ['auto'])}")
    return Attention(name, runs)


def picked(name, shape, device, dtype, dropout):
    """The kernel PyTorch's dispatch picks for causal attention over q, k, v of shape (B, heads, T, head size) that
    need gradients, laid out as model.MultiHeadAttention's (views of one projection), with name the only kernel
    allowed (auto: any); None where none can run it."""
    B, heads, T, size = shape
    projection = torch.empty(1, T, 3 * heads * size, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (t.view(1, T, heads, size).transpose(1, 2).expand(shape)  # (B rows without B copies)
               for t in projection.split(heads * size, dim=2))
    with Attention(name), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch warns of each kernel it passes over, and why)
        try:
            return _NAMES.get(torch._fused_sdp_choice(q, k, v, None, dropout, True))
        except (RuntimeError, NotImplementedError):  # no kernel can, or a device without PyTorch's choice
            return None
