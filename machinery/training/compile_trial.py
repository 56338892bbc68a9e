"""
torch.compile of the model train.py trains (--compile), tried on one forward and backward before training: where
the compiler fails (no C++ compiler, an op it cannot trace, ...) one warning, and training goes on uncompiled. The
trial leaves no trace: the batch sampler, every RNG (dropout) and the gradients are put back as they were. Not
owned: Muon's compiled Newton-Schulz (optimizers.py), decoding's compiled step (decode.py).
"""

import torch

from machinery.weights import checkpoint
from machinery.errors import first_line


def compiled_or_eager(model, sampler, optimizer, autocast, attention, log):
    """torch.compile(model), checked on one forward (in autocast and the attention kernel's context) and backward on
    a batch of sampler; on failure warn once and hand model back uncompiled."""
    compiled = torch.compile(model)
    saved = checkpoint.rank_state(sampler.state_dict())  # the trial must not shift data or dropout
    try:
        x, y = sampler.next()
        with autocast, attention:
            _, loss = compiled(x, y)
        loss.backward()
        return compiled
    except Exception as e:  # compilers fail in many ways; training can still go on
        log(f"warning: torch.compile failed ({type(e).__name__}: {first_line(e)}); training without it")
        return model
    finally:
        optimizer.zero_grad(set_to_none=True)
        checkpoint.restore_rank_state(saved, sampler)
