"""Test-wide set-up. Triton kernels run under the interpreter when there is no GPU; the
variable must be set before triton is first imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
