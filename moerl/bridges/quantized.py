"""Checkpoints stored quantized, dequantized tensor by tensor as they load: DeepSeek-style FP8 (E4M3 weights with a
``weight_scale_inv`` per block, 128 x 128 in the released ones) and GPT-OSS MXFP4 experts (``*_blocks``: two E2M1
values per byte, low nibble first, 32 values per block; ``*_scales``: one E8M0 exponent per block).

``config.json``'s ``quantization_config`` says which; any other ``quant_method`` is refused by name. A quantized
tensor and its scales may sit in different shards: the loader pairs them by name (``pairs``) and reads both, so at
most one dequantized tensor is held beyond the model.
"""

from __future__ import annotations

import torch

from moerl.errors import CheckpointError

METHODS = ("fp8", "mxfp4")
FP8_SCALE = "_scale_inv"  # "X.weight" (E4M3) + "X.weight_scale_inv" (fp32, one per block)
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"  # "X_blocks" (uint8 [..., out, in / 32, 16]) + "X_scales" (uint8)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantization(hf: dict, source: str) -> dict | None:
    """The checked ``quantization_config`` of a config.json dict (None when the checkpoint is not quantized)."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in METHODS:
        raise CheckpointError(
            f"{source}: quantization_config.quant_method={method!r} is not supported (allowed: {', '.join(METHODS)}); "
            "dequantize the checkpoint first"
        )
    if method == "fp8":
        fmt, block = q.get("fmt", "e4m3"), q.get("weight_block_size")
        if fmt != "e4m3":
            raise CheckpointError(f"{source}: quantization_config.fmt={fmt!r}: only e4m3 FP8 weights are supported")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{source}: quantization_config.weight_block_size={block!r}: needs [rows, cols]")
    return q


def pairs(names: list[str], q: dict | None) -> tuple[dict[str, tuple[str, str]], set[str]]:
    """(logical name -> (data tensor, scale tensor), names consumed by those pairs) for the checkpoint's names."""
    if q is None:
        return {}, set()
    present, out = set(names), {}
    if q["quant_method"] == "fp8":
        for name in names:
            if name.endswith(FP8_SCALE):
                data = name.removesuffix(FP8_SCALE)
                if data not in present:
                    raise CheckpointError(f"checkpoint has {name!r} but not the weight {data!r} it scales")
                out[data] = (data, name)
    else:
        for name in names:
            if name.endswith(MX_BLOCKS):
                base = name.removesuffix(MX_BLOCKS)
                if base + MX_SCALES not in present:
                    raise CheckpointError(f"checkpoint has {name!r} but not its scales {base + MX_SCALES!r}")
                out[base] = (name, base + MX_SCALES)
    return out, {n for pair in out.values() for n in pair}


def dequantize(q: dict, name: str, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor that quantized ``data`` with ``scales`` stands for (``name`` for errors), in the checkpoint's
    own layout: FP8 [out, in] (or [E, out, in]); MXFP4 experts transposed to [E, in, out] as GPT-OSS stores them."""
    if q["quant_method"] == "fp8":
        return dequantize_fp8(name, data, scales, q["weight_block_size"])
    return dequantize_mxfp4(name, data, scales).transpose(1, 2)


def dequantize_fp8(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """E4M3 ``weight`` [..., rows, cols] times its per-block ``scale_inv`` [..., ceil(rows / b0), ceil(cols / b1)];
    edge blocks may be partial, as in DeepSeek's reference."""
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"tensor {name!r}: FP8 checkpoint weight of dtype {weight.dtype}, expected float8_e4m3fn")
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise CheckpointError(
            f"tensor {name!r}: weight_scale_inv has shape {tuple(scale_inv.shape)}; a {tuple(weight.shape)} weight in "
            f"{block[0]} x {block[1]} blocks needs {(*weight.shape[:-2], *grid)}"
        )
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return weight.float() * s


def dequantize_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` uint8 [..., G, 16] (low nibble first) with E8M0 ``scales`` uint8 [..., G] -> fp32
    [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16:
        raise CheckpointError(
            f"tensor {name!r}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} / scales {tuple(scales.shape)} "
            f"{scales.dtype}; expected uint8 [..., G, 16] and uint8 [..., G]"
        )
    if blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"tensor {name!r}: MXFP4 scales {tuple(scales.shape)} do not match its blocks")
    lut = torch.tensor(_E2M1)
    values = torch.stack([lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)
