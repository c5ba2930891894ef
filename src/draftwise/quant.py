"""Weight-only int8 / int4 quantization of a draft model, for cheaper drafting on CPU.

The draft's precision cannot change draftwise's output: every draft token is checked by the
target, so a less exact draft only changes how many tokens are accepted, never which tokens
come out. Drafting on CPU is bound by the bytes of weights read per token: int8 weights read
half the bytes of bfloat16 ones, int4 a quarter.

Library use only for now (``quantize_weights(draft_lm.model, bits=8)``): no CLI flag applies it yet,
because its speed on this CPU has not been measured end to end (the CPU-speed issue).

Format (torch's packed int4 CPU kernel): each row of the weight is cut into groups of
``group_size`` input features; within a group ``w ~ (q - 8) * scale + zero`` with ``q`` in
0..15, ``scale = (max - min) / 15`` and ``zero = min + 8 * scale``.
"""

from __future__ import annotations

import torch
from torch import nn


class Int4Linear(nn.Module):
    """A linear layer with int4 weights (bfloat16 activations inside, any dtype outside)."""

    def __init__(self, linear: nn.Linear, group_size: int = 64) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group size {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        weight = linear.weight.detach().float()
        groups = weight.reshape(out_features, in_features // group_size, group_size)
        low = groups.amin(-1, keepdim=True)
        scale = ((groups.amax(-1, keepdim=True) - low) / 15).clamp_min(1e-8)
        q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        zero = low + 8 * scale
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [in_features / group_size, out_features, 2]: the layout the kernel expects.
        scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16))
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights, one scale per output feature (bfloat16 activations
    inside, any dtype outside): ``w ~ q * scale`` with ``q`` in -127..127."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8)  # [out_features]
        self.register_buffer("weight_int8", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_weights(model: nn.Module, bits: int = 8, group_size: int = 64) -> int:
    """Replace every eligible ``nn.Linear`` of ``model`` (output layer included) in place
    with an int8 (``bits=8``) or int4 (``bits=4``) weight-only layer.

    Returns how many layers were replaced. Layers the int4 kernel cannot take (input size
    not a multiple of ``group_size``, output size not a multiple of 16) stay as they are.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if bits == 8:
                setattr(parent, name, Int8Linear(child))
            elif child.in_features % group_size == 0 and child.out_features % 16 == 0:
                setattr(parent, name, Int4Linear(child, group_size))
            else:
                continue
            replaced += 1
    return replaced


def quantize_int4(model: nn.Module, group_size: int = 64) -> int:
    """``quantize_weights(model, bits=4)``."""
    return quantize_weights(model, bits=4, group_size=group_size)
