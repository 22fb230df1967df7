"""Self- and cross-attention inside a bag for models whose text is keys only (Wan).

A Wan sequence's text tokens are never queries: its image tokens attend to each other
(self-attention) and then to its text (cross-attention). After routing, bag rank p holds
chunk p of each of its bag's sequences: text rows (a chunk's tokens below its sequence's
text count; text comes first in a sequence) and image rows, each in chunk order. Two
``UlyssesLayout``s of the same plan, over each chunk's image part and over its text part,
trade tokens for heads for each kind on its own:

    self:   image q, k, v (Ni_p, H, D) -> every image token of the bag, H/g heads -> varlen -> back
    cross:  image q      (Ni_p, H, D) -> every image token of the bag, H/g heads
            text k, v    (Nt_p, H, D) -> every text token of the bag,  H/g heads
            each sequence's queries over its own text keys (lengths differ) -> back

Padding: Wan's pipeline pads every caption to 512 rows of zeros; after the projections
they are one key and value repeated, which ``cross_attention`` counts as one key whose
logit gets + log(rows). That key is the same for every sequence: each rank computes it
for every head and keeps its own block of heads, so it never travels.

Image context (Wan 2.1 I2V): each sequence also has L keys and values of its own (its
conditioning image's tokens), attended by the same queries, the two outputs summed before
the exchange back. They come from the sequence's condition row, which every rank holding
a chunk of the sequence already has (the row follows each chunk, even an empty one), so
each rank computes them for every head and, like the padding key, keeps its own block of
heads: they never travel.

A rank that also runs whole sequences of its own beside the bag's (a plan with
overlapping groups, ``UlyssesLayout.solo``) runs their self- and cross-attention as a bag
of one, with no exchange.

Plan first (``split_chunks``: which of a chunk's tokens are text, from the plan and
every sequence's text count, on the host), then execute thinly (``BagCrossAttention``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from knapray.indexing import permute_rows
from knapray.planning import BalancePlan
from knapray.transfer import host_to_device

from .ulysses import UlyssesAttention, UlyssesLayout, check_local, on_device, to_bag, to_tokens


def split_chunks(plan: BalancePlan, text_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(text, image) tokens of each of the plan's chunks, (C,) int64 each: a chunk covers
    positions ``[chunk_start, chunk_start + chunk_len)`` of its sequence, whose first
    ``text_tokens[seq]`` are text."""
    text_tokens = np.asarray(text_tokens, dtype=np.int64)
    if text_tokens.shape != plan.seq_lens.shape or np.any(text_tokens < 0) or np.any(text_tokens > plan.seq_lens):
        raise ValueError(f"text_tokens must give 0..length text tokens for each of the plan's "
                         f"{plan.num_sequences} sequences, got shape {text_tokens.shape}")
    text = np.clip(text_tokens[plan.chunk_seq] - plan.chunk_start, 0, plan.chunk_len)
    return text, plan.chunk_len - text


class BagCrossAttention:
    """``self_attn(q, k, v)`` over the bag's image tokens and ``cross_attn(q, k, v, pad,
    image)`` of image queries to text keys (and image-context keys), for one rank and plan
    (see the module docstring).

    Collective within the bag, as ``UlyssesAttention``: every rank of the bag calls both
    once per block, in the same order, also with no tokens. H must divide by the bag size.
    """

    def __init__(self, plan: BalancePlan, rank: int, group: dist.ProcessGroup | None, text_tokens: np.ndarray,
                 pad_to: int = 0, *, backend: str = "auto", device: torch.device | str | None = None) -> None:
        """``text_tokens``: (S,) text tokens of every sequence of the plan, in its order;
        ``pad_to``: text rows every sequence attends to, its tokens then padding (0: none)."""
        text_len, image_len = split_chunks(plan, text_tokens)
        image = UlyssesLayout.build(plan, rank, device, image_len)
        self.image = UlyssesAttention(plan, rank, group, backend=backend, device=device, layout=image)
        self.text = UlyssesLayout.build(plan, rank, device, text_len)
        self.group = group
        counts = np.asarray(text_tokens, dtype=np.int64)
        self.image_lens = list(image.seq_lens)
        """Image tokens of each of the bag's sequences (host ints, for the split)."""
        self.text_lens = counts[plan.bag_sequences(image.bag)].tolist()
        self.pad_counts = [max(pad_to - t, 0) for t in self.text_lens] if pad_to else None
        self.longest_text = int(counts.max(initial=0))
        """The most text tokens of any sequence of the plan: the same on every rank, so a
        check of it fails on all of them together."""
        recv = plan.recv_chunks(rank)
        self.local_sequences = int(recv.size)
        """S_loc: the rank's routed chunks, one condition row each (an empty chunk too)."""
        self.own = None
        """The same three lists for the rank's own whole sequences (``UlyssesLayout.solo``)."""
        self.sequence_rows = None
        """With ``own``: (S_loc,) int64, the rank's condition rows of the bag's sequences,
        then those of its own (both in plan order, as ``image_lens`` and ``own``)."""
        if image.solo is not None:
            own_text = counts[plan.solo_sequences(rank)].tolist()
            self.own = (list(image.solo.seq_lens), own_text,
                        [max(pad_to - t, 0) for t in own_text] if pad_to else None)
            solo = plan.bag[plan.chunk_seq[recv]] == plan.topology.solo_bag(rank)
            rows = np.concatenate([np.flatnonzero(~solo), np.flatnonzero(solo)])
            self.sequence_rows = host_to_device(rows, device, torch.int64)

    @property
    def choice(self):
        """The self-attention's ``AttentionChoice`` (None before the first call); the
        cross-attention runs per sequence on SDPA."""
        return self.image.choice

    def self_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Image q, k, v (Ni_p, H, D) -> (Ni_p, H, D): attention among each sequence's image tokens."""
        return self.image(q, k, v)

    def cross_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   pad: tuple[torch.Tensor, torch.Tensor] | None = None,
                   image: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Image queries q (Ni_p, H, D) to text keys and values k, v (Nt_p, H, D) of their
        sequences, plus the padding key ``pad`` ((H, D) each; None: no padding) -> (Ni_p, H, D).
        ``image``: (k, v) of the image context, (S_loc·L, H, D) each, L rows per condition
        row of this rank (one per routed chunk, in plan order), every head: each sequence's
        queries also attend to its L keys, and the two outputs are summed."""
        from knapray.attention import cross_attention

        if q.dim() != 3 or k.shape != v.shape or q.shape[1:] != k.shape[1:] or not q.dtype == k.dtype == v.dtype:
            raise ValueError(f"cross_attn takes q (Ni, H, D) and k, v (Nt, H, D) of one dtype, got "
                             f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
        img, txt = on_device(self.image.layout, q.device), on_device(self.text, q.device)
        self.image.layout, self.text = img, txt
        check_local(img, q, "image q")
        check_local(txt, k, "text k")
        pad = pad if self.pad_counts is not None else None
        ctx = None if image is None else self._image_rows(q, *image)
        if img.solo is None:
            return self._in_bag(q, k, v, pad, ctx, img, txt)
        # The bag's rows first, then the rank's own sequences (a bag of one), and back.
        qs = permute_rows(q, img.rows, img.rows_inverse)
        kv = permute_rows(torch.stack((k, v), dim=1), txt.rows, txt.rows_inverse)
        ni, nt, sb = img.local_tokens, txt.local_tokens, len(self.image_lens)
        bag_ctx = own_ctx = None
        if ctx is not None:
            ctx = ctx.index_select(0, self.sequence_rows.to(q.device))  # bag's sequences first, then own
            bag_ctx, own_ctx = ctx[:sb], ctx[sb:]
        bag_out = self._in_bag(qs[:ni], kv[:nt, 0], kv[:nt, 1], pad, bag_ctx, img, txt)
        image_lens, text_lens, pad_counts = self.own
        own_out = cross_attention(qs[ni:], kv[nt:, 0], kv[nt:, 1], image_lens, text_lens, pad, pad_counts)
        if own_ctx is not None:
            own_out = own_out + _image_attention(qs[ni:], own_ctx, image_lens)
        return permute_rows(torch.cat((bag_out, own_out)), img.rows_inverse, img.rows)

    def _image_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The image context's (S_loc·L, H, D) keys and values -> (S_loc, L, 2, H, D)."""
        s = self.local_sequences
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != q.shape[1:] or k.dtype != q.dtype \
                or (k.shape[0] % s if s else k.shape[0]):
            raise ValueError(f"cross_attn's image takes k, v (S_loc·L, H, D) like q's {tuple(q.shape[1:])} "
                             f"{q.dtype}, L rows for each of the rank's {s} sequences, got {tuple(k.shape)} "
                             f"{k.dtype}, {tuple(v.shape)} {v.dtype}")
        per_seq = k.shape[0] // s if s else 0
        # (S_loc·L, H, D) x 2 -> (S_loc·L, 2, H, D) -> (S_loc, L, 2, H, D)
        return torch.stack((k, v), dim=1).unflatten(0, (s, per_seq))

    def _in_bag(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad, ctx: torch.Tensor | None,
                img, txt) -> torch.Tensor:
        """Cross-attention of the bag's sequences (rows of this rank: its chunks of them);
        ``ctx``: (S_bag, L, 2, H, D) their image context's keys and values, or None."""
        from knapray.attention import cross_attention

        g, p = img.bag_size, img.rank_in_bag
        if g == 1:
            out = cross_attention(q, k, v, self.image_lens, self.text_lens, pad, self.pad_counts)
            return out if ctx is None else out + _image_attention(q, ctx, self.image_lens)
        hg = q.shape[1] // g
        qs = to_bag(q[:, None], img, self.group)[:, 0]  # (Ti, H/g, D)
        kv = to_bag(torch.stack((k, v), dim=1), txt, self.group)  # (Tt, 2, H/g, D)
        mine = None if pad is None else (pad[0][p * hg:(p + 1) * hg], pad[1][p * hg:(p + 1) * hg])
        out = cross_attention(qs, kv[:, 0], kv[:, 1], self.image_lens, self.text_lens, mine, self.pad_counts)
        if ctx is not None:  # this rank's block of heads of every sequence's image keys
            out = out + _image_attention(qs, ctx[:, :, :, p * hg:(p + 1) * hg], self.image_lens)
        return to_tokens(out, img, self.group)


def _image_attention(q: torch.Tensor, ctx: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """Each sequence's ``q_lens[i]`` queries of q (Nq, h, D) to its L image keys and values,
    ctx (S, L, 2, h, D) -> (Nq, h, D)."""
    from knapray.attention import cross_attention

    s, per_seq = ctx.shape[:2]
    kv = ctx.flatten(0, 1)  # (S·L, 2, h, D)
    return cross_attention(q, kv[:, 0], kv[:, 1], q_lens, [per_seq] * s)
