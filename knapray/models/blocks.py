"""Transformer blocks of the packed MMDiT. Everything here except ``attn`` is per token.

``attn(q, k, v)`` receives (N, H, D) tensors of the local tokens after QK-norm and RoPE and
returns (N, H, D); whether it is local varlen attention or a Ulysses exchange is not the
blocks' business. q, k and v arrive in one dtype, the compute dtype of the residual stream
(bf16 under bf16 autocast with fp32 parameters, and with bf16 parameters): the norms and
RoPE compute in fp32 but return their input's dtype.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from knapray.attention import AttentionFn
from knapray.indexing import merge_rows, split_rows
from knapray.models.config import MMDiTConfig
from knapray.models.layers import MLP, LayerNorm, Modulation, RMSNorm, apply_rope, modulate
from knapray.transfer import host_to_device


@dataclasses.dataclass(frozen=True, slots=True)
class TokenStreams:
    """Index maps between packed token order and the (text, image) sub-streams.

    Splitting and merging gather rows both ways (``knapray.indexing.split_rows`` and
    ``merge_rows``): each backward is a gather too, not a zero-filled scatter."""

    txt_idx: torch.Tensor
    """(Nt,) packed rows of text tokens, ascending."""
    img_idx: torch.Tensor
    """(Ni,) packed rows of image tokens, ascending."""
    unorder: torch.Tensor
    """(N,) gathers cat(text rows, image rows) back into packed order."""

    @classmethod
    def from_mask(cls, is_text: torch.Tensor) -> TokenStreams:
        """From the mask where it lives. On a GPU ``nonzero`` waits for the device (the host
        needs the count): a training step builds them with ``from_host_mask`` instead."""
        # Copies, not views of nonzero's (N, 1) result: compiled blocks guard on whether an
        # input is a view (its ``_base``), so every step must hand them the same kind.
        txt_idx = torch.nonzero(is_text).flatten().clone()
        img_idx = torch.nonzero(~is_text).flatten().clone()
        return cls(txt_idx, img_idx, torch.argsort(torch.cat((txt_idx, img_idx))))

    @classmethod
    def from_host_mask(cls, is_text: np.ndarray | torch.Tensor, device: torch.device | str | None) -> TokenStreams:
        """From a host copy of the mask, (N,) bool: the indices are computed on the host and
        copied to ``device`` without blocking it (``knapray.transfer.host_to_device``)."""
        if isinstance(is_text, torch.Tensor):  # .numpy() reads a host tensor without dispatching an op
            is_text = is_text.numpy() if is_text.device.type == "cpu" else is_text.cpu().numpy()
        mask = np.asarray(is_text, dtype=bool)
        txt_idx, img_idx = np.flatnonzero(mask), np.flatnonzero(~mask)
        unorder = np.argsort(np.concatenate((txt_idx, img_idx)), kind="stable")
        return cls(*(host_to_device(a, device, torch.int64) for a in (txt_idx, img_idx, unorder)))

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, ...) in packed order -> (text rows (Nt, ...), image rows (Ni, ...))."""
        return split_rows(x, self.txt_idx, self.img_idx, self.unorder)

    def merge(self, x_txt: torch.Tensor, x_img: torch.Tensor) -> torch.Tensor:
        """``split``'s inverse: (Nt, ...), (Ni, ...) -> (N, ...) in packed order."""
        return merge_rows(x_txt, x_img, self.txt_idx, self.img_idx, self.unorder)


def _qk_norm(cfg: MMDiTConfig) -> nn.Module:
    return RMSNorm(cfg.head_dim) if cfg.qk_norm else nn.Identity()


class StreamWeights(nn.Module):
    """One modality's weights in a double-stream block."""

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.mod = Modulation(d, 6)
        self.norm1 = LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.q_norm, self.k_norm = _qk_norm(cfg), _qk_norm(cfg)
        self.proj = nn.Linear(d, d)
        self.norm2 = LayerNorm(d)
        self.mlp = MLP(d, cfg.mlp_hidden, d)

    def attn_inputs(
        self, h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        qkv = self.qkv(modulate(self.norm1(h), shift, scale))
        # (n, 3*d) -> (n, 3, H, D) -> 3 x (n, H, D)
        q, k, v = qkv.reshape(n, 3, self.num_heads, self.head_dim).unbind(dim=1)
        return self.q_norm(q), self.k_norm(k), v

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor, mods: tuple[torch.Tensor, ...]) -> torch.Tensor:
        _, _, gate1, shift2, scale2, gate2 = mods
        h = h + gate1 * self.proj(attn_out)
        return h + gate2 * self.mlp(modulate(self.norm2(h), shift2, scale2))


class DoubleStreamBlock(nn.Module):
    """Flux double-stream block: separate text / image weights, one joint attention."""

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        self.txt = StreamWeights(cfg)
        self.img = StreamWeights(cfg)

    def forward(
        self,
        h_txt: torch.Tensor,
        h_img: torch.Tensor,
        vec_seq: torch.Tensor,
        seq_txt: torch.Tensor,
        seq_img: torch.Tensor,
        streams: TokenStreams,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mods_txt, mods_img = self.txt.mod(vec_seq, seq_txt), self.img.mod(vec_seq, seq_img)  # 6 x (Nt | Ni, d)
        q, k, v = self.joint_qkv(h_txt, h_img, mods_txt, mods_img, streams, rope)
        out = attn(q, k, v)  # in forward itself: compiled blocks break their graph here, and resume in this frame
        return self.joint_out(h_txt, h_img, out, mods_txt, mods_img, streams)

    def joint_qkv(self, h_txt: torch.Tensor, h_img: torch.Tensor, mods_txt: tuple[torch.Tensor, ...],
                  mods_img: tuple[torch.Tensor, ...], streams: TokenStreams, rope: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (N, H, D) of both streams in packed order, after QK-norm and RoPE, given each
        stream's 6 modulation tensors per token."""
        q_t, k_t, v_t = self.txt.attn_inputs(h_txt, mods_txt[0], mods_txt[1])
        q_i, k_i, v_i = self.img.attn_inputs(h_img, mods_img[0], mods_img[1])
        q, k, v = streams.merge(q_t, q_i), streams.merge(k_t, k_i), streams.merge(v_t, v_i)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def joint_out(self, h_txt: torch.Tensor, h_img: torch.Tensor, out: torch.Tensor, mods_txt: tuple[torch.Tensor, ...],
                  mods_img: tuple[torch.Tensor, ...], streams: TokenStreams) -> tuple[torch.Tensor, torch.Tensor]:
        """Each stream's projection and MLP after the joint attention's output ``out`` (N, H, D)."""
        n, n_heads, head_dim = out.shape
        out_t, out_i = streams.split(out.reshape(n, n_heads * head_dim))  # (N, H, D) -> (N, H*D)
        return self.txt.finish(h_txt, out_t, mods_txt), self.img.finish(h_img, out_i, mods_img)


class SingleStreamBlock(nn.Module):
    """Flux single-stream block, shared weights over all tokens.

    One fused input projection yields q, k, v and the MLP hidden; attention and the MLP run
    in parallel and one output projection consumes their concatenation.
    """

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim, self.mlp_hidden = cfg.num_heads, cfg.head_dim, cfg.mlp_hidden
        self.mod = Modulation(d, 3)
        self.norm = LayerNorm(d)
        self.linear1 = nn.Linear(d, 3 * d + self.mlp_hidden)
        self.q_norm, self.k_norm = _qk_norm(cfg), _qk_norm(cfg)
        self.linear2 = nn.Linear(d + self.mlp_hidden, d)

    def forward(
        self,
        h: torch.Tensor,
        vec_seq: torch.Tensor,
        seq_index: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionFn,
    ) -> torch.Tensor:
        q, k, v, mlp_in, gate = self.attn_inputs(h, self.mod(vec_seq, seq_index), rope)
        out = attn(q, k, v)  # in forward itself: compiled blocks break their graph here, and resume in this frame
        return self.attn_out(h, out, mlp_in, gate)

    def attn_inputs(self, h: torch.Tensor, mods: tuple[torch.Tensor, ...], rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, ...]:
        """q, k, v (N, H, D) after QK-norm and RoPE, the MLP's columns of ``linear1`` and the
        gate, given the block's shift, scale and gate per token (each (N, d))."""
        n, d = h.shape
        shift, scale, gate = mods
        qkv, mlp_in = self.linear1(modulate(self.norm(h), shift, scale)).split(
            [3 * d, self.linear1.out_features - 3 * d], dim=-1)
        # (N, 3*d) -> (N, 3, H, D) -> 3 x (N, H, D)
        q, k, v = qkv.reshape(n, 3, self.num_heads, self.head_dim).unbind(dim=1)
        return apply_rope(self.q_norm(q), *rope), apply_rope(self.k_norm(k), *rope), v, mlp_in, gate

    def attn_out(self, h: torch.Tensor, out: torch.Tensor, mlp_in: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The residual update from the attention's output (N, H, D) and the MLP."""
        n, d = h.shape
        return h + gate * self.linear2(torch.cat((out.reshape(n, d), self.activate(mlp_in)), dim=-1))

    def activate(self, mlp_in: torch.Tensor) -> torch.Tensor:
        """The MLP's activation of ``linear1``'s MLP columns: GELU (tanh)."""
        return F.gelu(mlp_in, approximate="tanh")


class FinalLayer(nn.Module):
    """adaLN LayerNorm + linear to patch features, applied to image tokens."""

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        self.mod = Modulation(cfg.hidden_size, 2)
        self.norm = LayerNorm(cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, cfg.out_patch_dim)

    def forward(self, h_img: torch.Tensor, vec_seq: torch.Tensor, seq_img: torch.Tensor) -> torch.Tensor:
        shift, scale = self.mod(vec_seq, seq_img)
        return self.linear(modulate(self.norm(h_img), shift, scale))
