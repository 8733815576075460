"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) as an attention op set of the shared
machinery: any family whose attention module has MLA's projections uses it through
``attention_ops(..., kind="mla")`` (``moe_family.py``).

HF's ``DeepseekV3Attention``, as ops (``n`` heads of this TP rank, ``dn``/``dr``/``dv`` the
``qk_nope_head_dim``/``qk_rope_head_dim``/``v_head_dim``, ``r`` the ``kv_lora_rank``)::

    attn.qkv   COMP  xf -> q,k,v    q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))    [b, n, s, dn+dr]
                                    latent, k_rot = kv_a_proj_with_mqa(x)  ([r | dr])
                                    k_nope, v = kv_b_proj(kv_a_layernorm(latent))               [b, n, s, dn], [.., dv]
                                    k = [k_nope | k_rot] (the one rope key of every head)
    attn.core  COMP  q,k,v -> o     RoPE (interleaved pairs when ``rope_interleave``) on the last
                                    dr dims of q and k, then HF's attention function (``scaling``
                                    with YaRN's mscale: the module's own)
    attn.out   COMP  o -> ao        o_proj (row-parallel)

TP: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are cut by heads (output rows), ``o_proj`` by
input columns; the latent projections and their norms stay whole on every TP rank, each rank's
gradient of them is the share its heads pass back, summed over TP like every replicated weight.
The RoPE runs in ``attn.core`` (after Ulysses' all-to-all, over the whole sequence), on each head's
copy of the rope key: the same values as HF's rope-then-expand, its gradient summed over the
heads after the rotation instead of before (fp32 rounding, within the HF tolerance).
"""

from __future__ import annotations

import torch

from .common import shard_param


def is_mla(attn_module) -> bool:
    return hasattr(attn_module, "kv_a_proj_with_mqa")


def check_config(config, name: str) -> None:
    """``ValueError`` for an MLA config HF's own attention cannot run either."""
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv != heads:
        raise ValueError(
            f"{name} with num_key_value_heads {kv} != num_attention_heads {heads}: multi-head latent "
            f"attention expands its latent into a key and value per query head; set "
            f"num_key_value_heads to {heads}"
        )


def qkv_fn(at):
    """``attn.qkv``: xf [s, b, h] -> q, k [b, n, s, dn+dr], v [b, n, s, dv] (RoPE not yet applied)."""
    dn, dr, dv, r = at.qk_nope_head_dim, at.qk_rope_head_dim, at.v_head_dim, at.kv_lora_rank

    def fn(side, xf):
        s, b, _ = xf.shape
        q = at.q_proj(xf) if at.q_lora_rank is None else at.q_b_proj(at.q_a_layernorm(at.q_a_proj(xf)))
        q = q.view(s, b, -1, dn + dr).permute(1, 2, 0, 3)
        latent, k_rot = at.kv_a_proj_with_mqa(xf).split([r, dr], dim=-1)
        kv = at.kv_b_proj(at.kv_a_layernorm(latent)).view(s, b, -1, dn + dv).permute(1, 2, 0, 3)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k_rot = k_rot.view(s, b, 1, dr).permute(1, 2, 0, 3).expand(-1, k_nope.shape[1], -1, -1)
        return q, torch.cat([k_nope, k_rot], dim=-1), v

    return fn


def rotary_fn(at, config, hf):
    """``attn_core_op``'s ``rotary``: RoPE on the last ``qk_rope_head_dim`` dims of q and k."""
    dn = at.qk_nope_head_dim
    apply = hf.apply_rotary_pos_emb_interleave if getattr(config, "rope_interleave", False) else hf.apply_rotary_pos_emb

    def fn(q, k, side):
        q_pass, q_rot = q[..., :dn], q[..., dn:]
        k_pass, k_rot = k[..., :dn], k[..., dn:]
        q_rot, k_rot = apply(q_rot, k_rot, side["cos"], side["sin"])
        return torch.cat([q_pass, q_rot], dim=-1), torch.cat([k_pass, k_rot], dim=-1)

    return fn


def shard(at, tp: int, tp_rank: int) -> None:
    """The head-wise projections by heads, ``o_proj`` by input columns; the latent ones stay whole."""
    for lin in (at.q_proj if at.q_lora_rank is None else at.q_b_proj, at.kv_b_proj):
        shard_param(lin, "weight", 0, tp_rank, tp)
    shard_param(at.o_proj, "weight", 1, tp_rank, tp)


def head_dims(at) -> tuple[int, int]:
    """(q/k head width, v head width): what Ulysses' all-to-all carries per head."""
    return at.qk_nope_head_dim + at.qk_rope_head_dim, at.v_head_dim
