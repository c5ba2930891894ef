"""Weight formats for CPU: weight-only int8 / int4 quantization of a draft model, for cheaper
drafting, and float32 weights pre-packed for oneDNN, for cheaper verification.

The draft's precision cannot change draftwise's output: every draft token is checked by the
target, so a less exact draft only changes how many tokens are accepted, never which tokens
come out. Drafting on CPU is bound by the bytes of weights read per token: int8 weights read
half the bytes of bfloat16 ones, int4 a quarter.

Packing (``pack_linears``) changes no weight: it stores each float32 matrix in the blocked
layout oneDNN's matrix product wants, once, instead of on every call. oneDNN picks the layout
for a given number of input rows, and the choice matters: a layout made for one row (a
decoding step) makes a block of several rows (a verification) cost much more than one made
for that many rows, while a layout made for several rows costs about as much on one row. A
target therefore keeps both (``TARGET_PACK_ROWS``; twice the weight memory, which ``load_lm``
only spends where the machine has it) and each call uses the layout made for the row count
nearest above its own, since a verification block is the cost speculation adds.
``scripts/pack_layouts.py`` measures the layouts on a given machine.

Format (torch's packed int4 CPU kernel): each row of the weight is cut into groups of
``group_size`` input features; within a group ``w ~ (q - 8) * scale + zero`` with ``q`` in
0..15, ``scale = (max - min) / 15`` and ``zero = min + 8 * scale``.
"""

from __future__ import annotations

import torch
from torch import nn

# Above this many rows (a long prompt's prefill) the weight-only kernels, made for a few
# rows, lose to dequantizing the weights and one dense float32 product: the kernels' cost
# grows per row faster than the dense product's, and dequantizing is a fixed cost paid once
# per call, so past some row count the dense path wins. Too low a threshold makes short
# prompts pay the dequantization on every prefill.
DENSE_ROWS = 128


class Int4Linear(nn.Module):
    """A linear layer with int4 weights (bfloat16 activations inside, any dtype outside)."""

    # Buffers (register_buffer), declared for the type checker.
    packed: torch.Tensor
    codes: torch.Tensor
    group_scale: torch.Tensor
    group_zero: torch.Tensor
    scales_zeros: torch.Tensor
    bias: torch.Tensor | None

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
        # The same codes unpacked, one per byte, for long prefills (see DENSE_ROWS).
        self.register_buffer("codes", q.to(torch.uint8))
        self.register_buffer("group_scale", scale)  # [out_features, groups, 1]
        self.register_buffer("group_zero", zero)
        # [in_features / group_size, out_features, 2]: the layout the kernel expects.
        scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16))
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def dense_weight(self) -> torch.Tensor:  # [out_features, in_features] float32
        groups = self.codes.view(self.out_features, -1, self.group_size).float()
        return ((groups - 8) * self.group_scale + self.group_zero).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > DENSE_ROWS:
            return _dense(self, x, flat)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros
        )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights, one scale per output feature (bfloat16 activations
    inside, any dtype outside): ``w ~ q * scale`` with ``q`` in -127..127."""

    # Buffers (register_buffer), declared for the type checker.
    weight_int8: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8)  # [out_features]
        self.register_buffer("weight_int8", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def dense_weight(self) -> torch.Tensor:  # [out_features, in_features] float32
        return self.weight_int8.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > DENSE_ROWS:
            return _dense(self, x, flat)
        out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.weight_int8, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _dense(layer: Int4Linear | Int8Linear, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``layer`` applied to many rows as one float32 product with its dequantized weights."""
    bias = layer.bias.float() if layer.bias is not None else None
    out = torch.nn.functional.linear(flat.float(), layer.dense_weight(), bias)
    return out.reshape(*x.shape[:-1], layer.out_features).to(x.dtype)


# Row counts the packed layouts of a target are made for: one-token steps (plain decoding, and
# speculation where the policy switched drafting off) and verification blocks of 2 or more.
# A draft model scores one new row at a time, so it keeps one layout (``DRAFT_PACK_ROWS``).
TARGET_PACK_ROWS = (1, 8)
DRAFT_PACK_ROWS = (1,)


class PackedLinear(nn.Module):
    """A float32 linear layer whose weight is pre-packed for oneDNN (same values, faster layout).

    ``rows`` lists the input row counts to keep a layout for; each costs one copy of the
    weight. A call with ``m`` rows uses the layout made for the smallest listed count that is
    at least ``m`` (the largest one above them all).

    Example: ``rows=(1, 8)``: a one-token step uses the one-row layout; a 2- or 6-token
    verification block and a 600-token prefill use the 8-row layout.
    """

    def __init__(self, linear: nn.Linear, rows: tuple[int, ...] = DRAFT_PACK_ROWS) -> None:
        super().__init__()
        if not rows or min(rows) < 1:
            raise ValueError(f"rows must be positive row counts, got {rows!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rows = tuple(sorted(set(rows)))
        weight = linear.weight.detach().float()
        # Opaque oneDNN tensors: kept out of state_dict (they cannot be saved or moved).
        for count in self.rows:
            self.register_buffer(
                f"packed_{count}", torch.ops.mkldnn._reorder_linear_weight(weight, count), persistent=False
            )
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def _packed_for(self, m: int) -> torch.Tensor:
        count = min((r for r in self.rows if r >= m), default=self.rows[-1])
        return getattr(self, f"packed_{count}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features).float()
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed_for(flat.shape[0]), self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def can_pack() -> bool:
    """Whether this torch build has the oneDNN kernels ``PackedLinear`` uses."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears(model: nn.Module, rows: tuple[int, ...] = DRAFT_PACK_ROWS) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` in place with a ``PackedLinear`` keeping
    a layout for each of ``rows``; return how many were replaced (0 where oneDNN is missing:
    the model is left as it is)."""
    if not can_pack():
        return 0
    return _replace_linears(
        model, lambda child: PackedLinear(child, rows) if child.weight.dtype == torch.float32 else None
    )


def _replace_linears(model: nn.Module, make) -> int:
    """Swap each ``nn.Linear`` for ``make(linear)`` where that is not None; count the swaps."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (new := make(child)) is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced


def quantize_weights(model: nn.Module, bits: int = 8, group_size: int = 64) -> int:
    """Replace every eligible ``nn.Linear`` of ``model`` (output layer included) in place
    with an int8 (``bits=8``) or int4 (``bits=4``) weight-only layer.

    Returns how many layers were replaced. Layers the int4 kernel cannot take (input size
    not a multiple of ``group_size``, output size not a multiple of 16) stay as they are.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")

    def make(child: nn.Linear) -> nn.Module | None:
        if bits == 8:
            return Int8Linear(child)
        if child.in_features % group_size == 0 and child.out_features % 16 == 0:
            return Int4Linear(child, group_size)
        return None

    return _replace_linears(model, make)
