"""Session-wide test settings."""
from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter. triton reads this when it is first imported,
# and transformers or torch may import it before any kernel test does, so it is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
