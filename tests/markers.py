"""Skip markers several test files share."""

import pytest
import torch

#: fp8 torch._scaled_mm runs on the CPU from torch 2.13
FP8_ON_CPU = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="fp8 torch._scaled_mm on the CPU needs torch >= 2.13")
