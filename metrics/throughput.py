"""Model FLOPs utilisation (docs/training.md, "MFU"): TFLOP/s per device = flops_per_token x tokens/s /
devices / 1e12, MFU = TFLOP/s per device / logging.peak_tflops. ``flops_per_token`` (model/counting.py)
counts the model's own training FLOPs, not recomputation, the optimizer or communication (that would be
hardware FLOPs utilisation): MFU compares runs and layouts on the work the model needs."""

from __future__ import annotations

from typing import Dict, Optional

from model.config import ModelConfig
from model.counting import flops_per_token

# Dense bf16 (fp16 on V100) peaks of one device, vendor datasheets: the table in docs/training.md.
# Matched against torch.cuda.get_device_name() in this order (the more specific names first).
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("B200", 2250.0), ("A100", 312.0),
               ("L40S", 362.0), ("L4", 121.0), ("V100", 125.0), ("MI300X", 1307.0), ("MI250X", 383.0))


def peak_tflops_of(device_name: str) -> Optional[float]:
    """The dense peak of a device by its name ("NVIDIA H200"), or None for one not in the table."""
    for key, tflops in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


class Throughput:
    def __init__(self, cfg: ModelConfig, seq_len: int, devices: int, peak_tflops: float):
        if devices < 1 or not peak_tflops > 0:
            raise ValueError(f"devices ({devices}) must be >= 1 and logging.peak_tflops ({peak_tflops}) > 0")
        self.flops_per_token = flops_per_token(cfg, seq_len)
        self.devices = devices
        self.peak_tflops = peak_tflops

    def __call__(self, tokens_per_s: float) -> Dict[str, float]:
        """{"tflops_per_device", "mfu"} at a training throughput of ``tokens_per_s`` (all devices)."""
        tflops = self.flops_per_token * tokens_per_s / self.devices / 1e12
        return {"tflops_per_device": tflops, "mfu": tflops / self.peak_tflops}
