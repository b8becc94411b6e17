"""mxfp8: full fine-tuning whose GEMMs run in MXFP8 (block 32, E8M0 scales, E4M3 data; ``moerl.model.mx``).

A sync sends each quantized GEMM weight as E4M3 data + E8M0 scales from the trainer's own quantizer (the engine
dequantizes on apply); an engine of plain weights (vLLM) gets ``dequantize(quantize(master))`` in bf16, which holds
every E4M3 x E8M0 value exactly, so it multiplies with the MX-rounded weights the trainer uses.
"""

from __future__ import annotations

import torch

from moerl.modes.full import Full


class MXFP8(Full):
    name = "mxfp8"
    untraced = "the MXFP8 projections' autograd functions (torchao's to_mx inside them) do not trace"

    def prepare(self, model, cfg) -> None:
        from moerl.model.mx import apply_mxfp8

        apply_mxfp8(model, cfg.mx_scale_mode)

    def engine_mx(self, cfg) -> str | None:
        return cfg.mx_scale_mode

    def sends_rounded(self, policy, name: str) -> bool:
        from moerl.model.mx import quantized_weight

        return not quantized_weight(name, policy.model)  # a GEMM weight is quantized from its fp32 master

    def weight_form(self, policy, name: str, master: torch.Tensor, dense: str | None):
        from moerl.model.mx import BLOCK, MX_SCALE, mx_fake_quant, mx_quantize, quantized_weight

        if not quantized_weight(name, policy.model):
            yield from super().weight_form(policy, name, master, dense)
        elif master.shape[-1] % BLOCK == 0 and not dense:
            scale, data = mx_quantize(master, policy.cfg.mx_scale_mode)
            yield name, data
            yield name + MX_SCALE, scale
        else:  # a ragged last block, or a dense engine: the MX values themselves (bf16 holds them exactly)
            yield name, mx_fake_quant(master, -1, policy.cfg.mx_scale_mode).to(torch.bfloat16)
