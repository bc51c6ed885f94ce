"""FP8 (e4m3) block quantization: weights per 2-D block, activations per token group.

Torch references; the Triton versions keep these signatures. The scheme is DeepSeek-V3's:
each block stores ``x / s`` in float8_e4m3fn with ``s = amax(|x|) / 448`` kept in float32,
so ``x ≈ x_fp8.float() * s``. Checkpoints call ``s`` the ``weight_scale_inv``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.backend import use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# the block edge of weight scales (128x128) and the group width of activation scales (1x128)
FP8_BLOCK = 128
# An all-zero block would give a zero scale and 0/0 on quantization; any positive scale
# reproduces the zeros, and this one is the same floor vLLM and SGLang use.
SCALE_EPS = 1e-10


def block_quant_fp8(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight per ``block`` tile, as in DeepSeek-V3's released checkpoints.

    ``w [N, K]`` (any float dtype) -> ``(w_fp8 [N, K] float8_e4m3fn,
    scale_inv [ceil(N/bn), ceil(K/bk)] float32)`` with ``w ≈ w_fp8.float() * scale_inv``
    broadcast over each tile. Edge tiles may be partial (N, K need not be multiples).
    """
    _check_2d(w, "w")
    n, k = w.shape
    bn, bk = block
    tiles = _to_tiles(w.float(), bn, bk)  # [N/bn, bn, K/bk, bk]
    amax = tiles.abs().amax(dim=(1, 3))  # [N/bn, K/bk]
    scale_inv = amax.clamp(min=SCALE_EPS) / FP8_MAX
    q = _cast_fp8(tiles / scale_inv[:, None, :, None])
    return _from_tiles(q, n, k), scale_inv


def block_dequant_fp8(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``block_quant_fp8``.

    ``w_fp8 [N, K]`` float8_e4m3fn, ``scale_inv [ceil(N/bn), ceil(K/bk)]`` -> ``[N, K]`` in ``dtype``
    (the product is formed in float32, then cast).
    """
    _check_2d(w_fp8, "w_fp8")
    n, k = w_fp8.shape
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)}; a [{n}, {k}] weight in {bn}x{bk} blocks needs {expected}"
        )
    tiles = _to_tiles(w_fp8.float(), bn, bk)  # [N/bn, bn, K/bk, bk]
    tiles = tiles * scale_inv.float()[:, None, :, None]
    return _from_tiles(tiles, n, k).to(dtype)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations with one scale per ``group_size`` consecutive values of the last dim.

    ``x [..., K]`` -> ``(x_fp8 [..., K] float8_e4m3fn, scales [..., ceil(K/g)] float32)`` with
    ``x ≈ x_fp8.float() * scales`` repeated over each group; the last group may be partial.
    """
    if use_triton(x):
        from moeserve.kernels.triton import quant as triton_quant

        return triton_quant.per_token_group_quant_fp8(x, group_size)
    return per_token_group_quant_fp8_ref(x, group_size)


def per_token_group_quant_fp8_ref(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version of ``per_token_group_quant_fp8``."""
    k = x.shape[-1]
    groups = _to_groups(x.float(), group_size)  # [..., K/g, g]
    scales = groups.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX  # [..., K/g]
    q = _cast_fp8(groups / scales[..., None])
    return q.flatten(-2)[..., :k].contiguous(), scales


def per_token_group_dequant_fp8(
    x_fp8: torch.Tensor, scales: torch.Tensor, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of ``per_token_group_quant_fp8``: ``x_fp8 [..., K]``, ``scales [..., ceil(K/g)]`` -> ``[..., K]``."""
    k = x_fp8.shape[-1]
    expected = (*x_fp8.shape[:-1], -(-k // group_size))
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales has shape {tuple(scales.shape)}; expected {expected} for group_size {group_size}")
    groups = _to_groups(x_fp8.float(), group_size) * scales.float()[..., None]  # [..., K/g, g]
    return groups.flatten(-2)[..., :k].to(dtype)


def quantize_kv_rows(latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's cached keys in FP8 (the KV cache's ``fp8_e4m3`` form): ``latent [T, L]`` with one
    scale per ``FP8_BLOCK``-wide tile, ``rope [T, R]`` with one scale a token -> ``(values [T, L + R]
    float8_e4m3fn, scales [T, ceil(L/128) + 1] float32)``, the rope key's scale last. Torch on
    every device, so every path that writes a token (prefill, decode, a transfer's source) writes
    the same bytes."""
    latent_q, latent_s = per_token_group_quant_fp8_ref(latent, FP8_BLOCK)
    rope_q, rope_s = per_token_group_quant_fp8_ref(rope, rope.shape[-1])
    return torch.cat([latent_q, rope_q], -1), torch.cat([latent_s, rope_s], -1)


def dequantize_kv_rows(values: torch.Tensor, scales: torch.Tensor, latent_dim: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_kv_rows``: ``values [S, L + R]``, ``scales [S, ceil(L/128) + 1]`` ->
    ``[S, L + R]`` in ``dtype`` (``value.float() * scale``, then cast)."""
    latent = per_token_group_dequant_fp8(values[:, :latent_dim], scales[:, :-1], FP8_BLOCK, dtype)
    rope = (values[:, latent_dim:].float() * scales[:, -1:]).to(dtype)
    return torch.cat([latent, rope], -1)


def _cast_fp8(x: torch.Tensor) -> torch.Tensor:
    # Rounding can push amax/scale a hair past 448, and some backends turn overflow into NaN.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _to_tiles(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``[N, K]`` -> zero-padded ``[ceil(N/bn), bn, ceil(K/bk), bk]``; padding never raises an amax."""
    n, k = w.shape
    w = F.pad(w, (0, -k % bk, 0, -n % bn))
    return w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)


def _from_tiles(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[N/bn, bn, K/bk, bk]`` -> ``[N, K]`` with the padding cut off."""
    nb, bn, kb, bk = tiles.shape
    return tiles.reshape(nb * bn, kb * bk)[:n, :k].contiguous()


def _to_groups(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[..., K]`` -> zero-padded ``[..., ceil(K/g), g]``."""
    x = F.pad(x, (0, -x.shape[-1] % g))
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def _check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, K], got shape {tuple(t.shape)}")


def fp8_block_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """DeepSeek-V3's w8a8 block-scaled linear: ``out = (x_fp8 * x_scale) @ (w_fp8 * w_scale).T``.

    ``x_fp8 [M, K]`` float8_e4m3fn with ``x_scale [M, ceil(K/128)]`` fp32 (from
    ``per_token_group_quant_fp8`` with groups of 128), ``w_fp8 [N, K]`` float8_e4m3fn with
    ``w_scale [ceil(N/128), ceil(K/128)]`` fp32 (``block_quant_fp8``'s 128x128 blocks)
    -> ``[M, N]`` in ``out_dtype``. Callers flatten leading dims of x first.
    """
    if use_triton(x_fp8):
        from moeserve.kernels.triton import gemm as triton_gemm

        return triton_gemm.fp8_block_gemm(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    return fp8_block_gemm_ref(x_fp8, x_scale, w_fp8, w_scale, out_dtype)


def fp8_block_gemm_ref(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Torch version of ``fp8_block_gemm``: both operands dequantized to fp32, one matmul."""
    if x_fp8.dim() != 2 or w_fp8.dim() != 2:
        raise ValueError(f"x_fp8 [M, K] and w_fp8 [N, K] must be 2-D, got {tuple(x_fp8.shape)}, {tuple(w_fp8.shape)}")
    x = per_token_group_dequant_fp8(x_fp8, x_scale, FP8_BLOCK)  # [M, K] fp32
    w = block_dequant_fp8(w_fp8, w_scale, (FP8_BLOCK, FP8_BLOCK))  # [N, K] fp32
    return (x @ w.t()).to(out_dtype)
